-- requires_spec.lua — the require graph of the Lua library (lua/fsdp) has no cycle, and no file
-- but init.lua requires "fsdp" (docs/ARCHITECTURE.md, "The files of the sharding layer and who
-- requires whom"). Edges are every `require "fsdp..."` in a file's code, at its top or inside a
-- function, plus, for init.lua, the files it loads on first use of a name (the module names in
-- its tables): a lazy require is still a dependency, and the cycle through init.lua's lazy
-- loading is the one this spec keeps out. The one exception is repl.lua's M.preload, which
-- requires "fsdp" at REPL time to make it a global.
-- Run: busted --lua=luajit tests/lua/requires_spec.lua

-- the library under test: the files package.path finds
local lib_dir = assert(package.searchpath("fsdp.util", package.path)):match("^(.*)/util%.lua$")

-- The code of a Lua source with its comments removed (strings kept, so a "--" inside one does
-- not hide the rest of its line).
local function strip_comments(src)
  local out, i, n = {}, 1, #src
  local function long_bracket(at) -- level of a [[ / [=[ opening at `at`, or nil
    local eq = src:match("^%[(=*)%[", at)
    return eq and #eq or nil
  end
  while i <= n do
    local c = src:sub(i, i)
    if c == "-" and src:sub(i + 1, i + 1) == "-" then
      local level = long_bracket(i + 2)
      if level then
        local _, close = src:find("]" .. ("="):rep(level) .. "]", i + 4 + level, true)
        i = (close or n) + 1
      else
        local eol = src:find("\n", i, true)
        i = eol or n + 1
      end
    elseif c == '"' or c == "'" then
      local j = i + 1
      while j <= n do
        local d = src:sub(j, j)
        if d == "\\" then j = j + 1 elseif d == c or d == "\n" then break end
        j = j + 1
      end
      out[#out + 1] = src:sub(i, j)
      i = j + 1
    elseif c == "[" and long_bracket(i) then
      local level = long_bracket(i)
      local _, close = src:find("]" .. ("="):rep(level) .. "]", i + 2 + level, true)
      out[#out + 1] = src:sub(i, close or n)
      i = (close or n) + 1
    else
      out[#out + 1] = c
      i = i + 1
    end
  end
  return table.concat(out)
end

-- The modules a piece of code requires: array of {name =, at = position}.
local function requires_in(code)
  local found = {}
  for _, pat in ipairs { [[()require%s*%(?%s*"([%w_.]+)"]], [[()require%s*%(?%s*'([%w_.]+)']] } do
    for at, name in code:gmatch(pat) do found[#found + 1] = {name = name, at = at} end
  end
  table.sort(found, function(a, b) return a.at < b.at end)
  return found
end

-- A cycle of graph (name -> array of names) as an array of names (first = last), or nil.
local function find_cycle(graph)
  local color, stack = {}, {}
  local function visit(v)
    color[v] = "open"
    stack[#stack + 1] = v
    for _, w in ipairs(graph[v] or {}) do
      if color[w] == "open" then
        local cycle = {}
        for k = #stack, 1, -1 do
          table.insert(cycle, 1, stack[k])
          if stack[k] == w then break end
        end
        cycle[#cycle + 1] = w
        return cycle
      elseif color[w] == nil then
        local c = visit(w)
        if c then return c end
      end
    end
    stack[#stack] = nil
    color[v] = "done"
    return nil
  end
  local names = {}
  for v in pairs(graph) do names[#names + 1] = v end
  table.sort(names)
  for _, v in ipairs(names) do
    if color[v] == nil then
      local c = visit(v)
      if c then return c end
    end
  end
  return nil
end

-- Every file of the library: array of {module =, path =, code =}, sorted by module name.
local function library_files()
  local files = {}
  local p = assert(io.popen(("find '%s' -name '*.lua' | sort"):format(lib_dir)))
  for path in p:lines() do
    local rel = path:sub(#lib_dir + 2):gsub("%.lua$", "")
    local module = rel == "init" and "fsdp" or "fsdp." .. rel:gsub("/init$", ""):gsub("/", ".")
    local f = assert(io.open(path, "rb"))
    files[#files + 1] = {module = module, path = path, code = strip_comments(f:read("*a"))}
    f:close()
  end
  p:close()
  table.sort(files, function(a, b) return a.module < b.module end)
  return files
end

-- The part of repl.lua's code that may require "fsdp": the body of M.preload.
local function preload_span(code)
  local first = code:find("function M.preload", 1, true)
  if not first then return nil end
  local _, last = code:find("\nend", first, true)
  return first, last
end

-- The require graph of the library (module -> sorted array of library modules it requires)
-- and the places that require "fsdp" (array of "module" strings).
local function library_graph(files)
  local graph, known, to_init = {}, {}, {}
  for _, f in ipairs(files) do known[f.module] = true end
  for _, f in ipairs(files) do
    local seen, edges = {}, {}
    local function add(name)
      if known[name] and not seen[name] and name ~= f.module then
        seen[name] = true
        edges[#edges + 1] = name
      end
    end
    local lo, hi
    if f.module == "fsdp.repl" then lo, hi = preload_span(f.code) end
    for _, r in ipairs(requires_in(f.code)) do
      if r.name == "fsdp" and f.module ~= "fsdp" then
        if not (lo and r.at >= lo and r.at <= hi) then
          to_init[#to_init + 1] = f.module
          add(r.name)
        end
      else
        add(r.name)
      end
    end
    if f.module == "fsdp" then
      -- the files init.lua loads on first use: every module name in its code
      for name in f.code:gmatch([["(fsdp%.[%w_.]+)"]]) do add(name) end
    end
    table.sort(edges)
    graph[f.module] = edges
  end
  return graph, to_init
end

local function has(list, v)
  for _, x in ipairs(list) do if x == v then return true end end
  return false
end

describe("the require graph of lua/fsdp", function()
  local files = library_files()
  local graph, to_init = library_graph(files)

  it("holds every file of the library and the edges known to exist", function()
    assert.is_true(#files >= 20, ("read only %d files under %s"):format(#files, lib_dir))
    local function edge(a, b)
      assert.is_true(has(graph[a] or {}, b), ("no edge %s -> %s found"):format(a, b))
    end
    edge("fsdp.wrap", "fsdp.meta")       -- at the top of wrap.lua
    edge("fsdp.util", "fsdp.log")
    edge("fsdp.nn.module", "fsdp.seed")
    edge("fsdp", "fsdp.seed")
    edge("fsdp", "fsdp.nn")              -- loaded on first use of fsdp.nn
    edge("fsdp", "fsdp.repl")            -- fsdp.debug
  end)

  it("has no file but init.lua requiring \"fsdp\" (repl.lua's preload aside)", function()
    assert.are.same({}, to_init)
    local repl
    for _, f in ipairs(files) do if f.module == "fsdp.repl" then repl = f end end
    assert.truthy(repl and preload_span(repl.code), "repl.lua has no M.preload: update this spec")
  end)

  it("has no cycle", function()
    local cycle = find_cycle(graph)
    assert.is_nil(cycle, cycle and ("require cycle: " .. table.concat(cycle, " -> ")))
  end)

  it("is checked by a scan that sees cycles, skips comments and reads strings whole", function()
    assert.are.same({"a", "b", "c", "a"}, find_cycle {a = {"b"}, b = {"c"}, c = {"a"}, d = {"a"}})
    assert.is_nil(find_cycle {a = {"b", "c"}, b = {"c"}, c = {}})
    local code = strip_comments([===[
local s = "--" local a = require "fsdp.a" -- require "fsdp.b"
--[==[ require "fsdp.c" ]==] local d = require("fsdp.d")
local e = [[ -- ]] local f = require 'fsdp.f'
]===])
    local names = {}
    for _, r in ipairs(requires_in(code)) do names[#names + 1] = r.name end
    assert.are.same({"fsdp.a", "fsdp.d", "fsdp.f"}, names)
  end)

  it("lets every file load without loading init.lua", function()
    local bad = {}
    for _, f in ipairs(files) do
      if f.module ~= "fsdp" then
        local cmd = ([[luajit -e "require '%s' io.write(package.loaded.fsdp and 'loaded' or 'clean')" 2>&1]])
          :format(f.module)
        local p = assert(io.popen(cmd))
        local out = p:read("*a")
        p:close()
        if out ~= "clean" then bad[#bad + 1] = f.module .. ": " .. out end
      end
    end
    assert.are.same({}, bad)
  end)
end)
