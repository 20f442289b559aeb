-- repl_spec.lua — lua/fsdp/repl.lua: the REPL's tab completion (fsdp.repl.complete) on plain
-- tables, metatables (__index tables, __complete, __methods of tensors, nn module fields),
-- paths with bracketed keys, and words that must give nothing (no code runs: an __index
-- function is never called); the globals that `fsdprun -i` preloads (fsdp.repl.preload). The
-- terminal side (libedit, listing) is tests/recipes/repl_tty.sh.
-- Run: busted --lua=luajit tests/lua/repl_spec.lua

local fsdp = require "fsdp"
local repl = require "fsdp.repl"

local function names(line, env)
  local list = repl.complete(line, env)
  return table.concat(list, " ")
end

describe("fsdp.repl.complete", function()
  local called = false
  local env = {
    cfg = { alpha = 1, beta = 2, alps = 3, __hidden = 4, [1] = "one" },
    deep = { layers = { { alpha = 4 } }, ["odd key"] = { zeta = 1 } },
    obj = setmetatable({ own = 1 }, { __index = setmetatable({ inherited = 1, go = print },
      { __index = { grand = 1 } }) }),
    trap = setmetatable({}, { __index = function() called = true; return {} end }),
    listed = setmetatable({}, { __complete = function() return { "lazy_a", "lazy_b" } end }),
    broken = setmetatable({}, { __complete = function() error("no") end }),
    fsdp = fsdp,
    t = fsdp.ones{2},
    lin = fsdp.nn.Linear(2, 3),
    format = "x",
  }

  it("completes globals, fields and keywords, with the text to insert", function()
    local list, add = repl.complete("cfg.al", env)
    assert.are.same({ "alpha", "alps" }, list)
    assert.are.equal("p", add) -- their common prefix
    list, add = repl.complete("x = cfg.alp", env)
    assert.are.same({ "alpha", "alps" }, list)
    assert.are.equal("", add)
    list, add = repl.complete("cfg.b", env)
    assert.are.same({ "beta" }, list)
    assert.are.equal("eta", add)
    assert.are.equal("cfg", names("cf", env))
    assert.are.equal("false for format fsdp function", names("f", env))
    assert.are.equal("", names("cfg.fo", env)) -- no keywords after a '.'
  end)

  -- line before the cursor -> the candidates, space-separated
  local cases = {
    ["__ names only after '_'"] = {
      ["cfg."] = "alpha alps beta", ["cfg._"] = "__hidden",
    },
    ["__index tables, __complete and nn module fields"] = {
      ["obj."] = "go grand inherited own",
      ["obj:"] = "go", -- methods: functions only
      ["listed.lazy"] = "lazy_a lazy_b",
      ["broken."] = "",
      ["lin.wei"] = "weight",
    },
    ["tensor methods through __methods"] = {
      ["t:nu"] = "numel", ["lin.weight:nu"] = "numel",
    },
    ["paths with bracketed keys"] = {
      ["deep.layers[1].al"] = "alpha",
      ['x(deep["layers"][1].al'] = "alpha",
      ["deep['odd key'].z"] = "zeta",
      ["deep.layers[2].al"] = "",
      ["deep.layers[1]"] = "",
      ["deep.layers[x].al"] = "",
    },
  }
  for what, lines in pairs(cases) do
    it("completes " .. what, function()
      for line, want in pairs(lines) do
        assert.are.equal(want, names(line, env), line)
      end
    end)
  end

  it("completes the fsdp table's names, also those it loads on first use", function()
    assert.is_true(names("fsdp.wor", env):find("world_size", 1, true) ~= nil)
    assert.is_true(names("fsdp.re", env):find("retie", 1, true) ~= nil)
  end)

  it("gives nothing for paths that do not resolve, and runs no __index function", function()
    assert.are.equal("", names("nope.x", env))
    assert.are.equal("", names("obj:go.x", env)) -- a:b.c is no path
    assert.are.equal("", names("trap.x.y", env))
    assert.is_false(called)
  end)
end)

describe("fsdp.repl.preload", function()
  it("sets fsdp and nn where they are unset, and says which hold the modules", function()
    local env = {}
    assert.are.equal("fsdp and nn are globals", repl.preload(env))
    assert.are.equal(fsdp, env.fsdp)
    assert.are.equal(fsdp.nn, env.nn)
    assert.are.equal("Linear", table.concat(repl.complete("nn.Line", env), " "))
  end)

  it("keeps what the recipe set", function()
    local env = { nn = "mine" }
    assert.are.equal("fsdp is a global", repl.preload(env))
    assert.are.equal("mine", env.nn)
    env = { nn = 1, fsdp = 2 }
    assert.is_nil(repl.preload(env))
    assert.are.equal(2, env.fsdp)
  end)
end)
