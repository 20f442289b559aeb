-- api_spec.lua — every name docs/api.md lists exists: the names in its lua code blocks
-- (fsdp.X.Y, nn.X, prune.X, and methods called on a tensor t, a module m/model, an optimizer
-- opt, a loader, a unit u, a schedule s), found on the objects the page names. A name the
-- page lists and the code lacks fails here, naming it.
-- Run: busted --lua=luajit tests/lua/api_spec.lua

local fsdp = require "fsdp"
local nn = fsdp.nn
local H = require "helpers"
teardown(H.remove_temps)

local function read_page()
  local dir = os.getenv("FSDP_SOURCE_DIR") or "."
  local f = assert(io.open(dir .. "/docs/api.md", "rb"))
  local s = f:read("*a")
  f:close()
  return s
end

-- the code of the page's lua blocks, without comments
local function code_of(page)
  local lines = {}
  for block in page:gmatch("```lua\n(.-)```") do
    for line in block:gmatch("[^\n]*") do
      lines[#lines + 1] = (line:gsub("%-%-.*$", ""))
    end
  end
  return table.concat(lines, "\n")
end

-- a callable: a function, or a table or userdata with __call
local function callable(v)
  if type(v) == "function" then return true end
  local mt = getmetatable(v)
  return type(mt) == "table" and mt.__call ~= nil
end

-- root.a.b.c resolved (nil when a step is missing), through each table's __index
local function resolve(root, dotted)
  local v = root
  for k in dotted:gmatch("[^.]+") do
    if type(v) ~= "table" and type(v) ~= "userdata" then return nil end
    v = v[k]
    if v == nil then return nil end
  end
  return v
end

local page = read_page()
local code = code_of(page)

-- the objects methods are looked up on
local function tmpfile(text)
  local p = H.tmpname()
  local f = assert(io.open(p, "wb"))
  f:write(text)
  f:close()
  return p
end

local function receivers()
  fsdp.manual_seed(1)
  local model = nn.GPT{vocab = 11, ctx = 8, d = 8, layers = 1, heads = 2}
  local wrapped = nn.GPT{vocab = 11, ctx = 8, d = 8, layers = 1, heads = 2}
  fsdp.wrap(wrapped, {policy = fsdp.policy.modules{nn.Block}})
  local text = tmpfile(("the quick brown fox jumps over the lazy dog "):rep(20))
  local r = {
    t = fsdp.zeros{2, 2},
    m = model,
    model = model,
    opt = fsdp.optim.AdamW(model, {lr = 1e-3}),
    loader = fsdp.data.text(text, {ctx = 8, batch = 2}),
    u = fsdp.units(wrapped)[1],
    s = fsdp.prune.schedule{{kind = "gmp", params = "weight", start = 1, stop = 2, every = 1,
                             init = 0.1, final = 0.5}},
  }
  return r, function() os.remove(text) end
end

describe("docs/api.md", function()
  it("lists names of fsdp, nn and prune that exist", function()
    local missing, seen, checked = {}, {}, 0
    local function check(root, prefix, name)
      local full = prefix .. name
      if seen[full] then return end
      seen[full] = true
      checked = checked + 1
      if resolve(root, name) == nil then missing[#missing + 1] = full end
    end
    -- fsdp.a.b (and fsdp.a:b, a method on a library object: nn.Module:extend)
    for pre, name in code:gmatch("([%w_]*)fsdp%.([%w_%.]*[%w_])") do
      if pre == "" then check(fsdp, "fsdp.", name) end
    end
    for pre, name in code:gmatch("([%w_%.]?)nn%.([%w_%.:]*[%w_])") do
      if pre == "" then check(nn, "nn.", (name:gsub(":", "."))) end
    end
    for pre, name in code:gmatch("([%w_%.]?)prune%.([%w_]+)") do
      if pre == "" then check(fsdp.prune, "prune.", name) end
    end
    assert.is_true(checked > 60, "the page's names were not found: " .. checked)
    assert.are.same({}, missing)
  end)

  it("lists methods that the objects it names have", function()
    local r, cleanup = receivers()
    local missing, seen, checked = {}, {}, 0
    for pre, recv, name in code:gmatch("([%w_%.]?)([%a_][%w_]*):([%a_][%w_]*)") do
      local obj = pre == "" and r[recv]
      if obj and not seen[recv .. ":" .. name] then
        seen[recv .. ":" .. name] = true
        checked = checked + 1
        if not callable(obj[name]) then missing[#missing + 1] = recv .. ":" .. name end
      end
    end
    -- "fsdp.abs fsdp.where ... -- also as t:method()"
    local line = page:match("\n(fsdp%.abs[^\n]*)")
    assert.truthy(line, "the line of tensor functions that are also methods")
    for name in line:gmatch("fsdp%.([%w_]+)") do
      checked = checked + 1
      if not callable(r.t[name]) then missing[#missing + 1] = "t:" .. name end
    end
    cleanup()
    assert.is_true(checked > 30, "the page's methods were not found: " .. checked)
    assert.are.same({}, missing)
  end)

  it("lists fsdp.wrap options that wrap knows", function()
    local keys, n = {}, 0
    for tbl in code:gmatch("fsdp%.wrap%(model, (%b{})") do
      -- top-level keys only (mp = {param =, ...} names mp's own)
      for k in tbl:sub(2, -2):gsub("%b{}", ""):gmatch("([%a_][%w_]*)%s*=") do keys[k] = true end
    end
    for k in pairs(keys) do
      n = n + 1
      -- a value of the wrong type may be refused, but not the name
      local ok, err = pcall(fsdp.wrap, nn.Linear(2, 2), {[k] = {}})
      assert.is_true(ok or not tostring(err):find("unknown option", 1, true), k .. ": " .. tostring(err))
    end
    assert.is_true(n >= 8, "wrap options found: " .. n)
    -- and the check itself refuses what wrap does not know
    local ok, err = pcall(fsdp.wrap, nn.Linear(2, 2), {no_such_option = 1})
    assert.is_false(ok)
    assert.truthy(tostring(err):find("unknown option", 1, true))
  end)

  it("names the GPT's children and their paths as the model has them", function()
    assert.truthy(page:find("children: wte, wpe, blocks (ModuleList of Block), ln_f, head", 1, true))
    assert.truthy(page:find("Block: ln1, attn (CausalSelfAttention: qkv, proj), ln2, mlp (MLP: fc, proj)", 1, true))
    fsdp.manual_seed(1)
    local g = nn.GPT{vocab = 11, ctx = 8, d = 8, layers = 1, heads = 2, tie = true}
    local paths = {}
    for path in g:named_parameters() do paths[path] = true end
    for _, p in ipairs{"wte.weight", "wpe.weight", "blocks.1.ln1.weight", "blocks.1.attn.qkv.weight",
                       "blocks.1.attn.proj.weight", "blocks.1.ln2.weight", "blocks.1.mlp.fc.weight",
                       "blocks.1.mlp.proj.weight", "ln_f.weight"} do
      assert.is_true(paths[p], p)
    end
    assert.is_nil(paths["head.weight"]) -- tied: listed once, under wte.weight
    assert.are.equal(g.head.weight, g.wte.weight)
  end)
end)
