-- args_spec.lua — recipe arguments declared once (lua/fsdp/args.lua): the declaration's own
-- checks, parsing (both spellings of a value, booleans, hyphens), each refusal naming the
-- argument, and the help text. The command line (--help exiting 0, status 2, -n N) is
-- tests/recipes/cli_args.sh's.
-- Run: busted --lua=luajit tests/lua/args_spec.lua
local A = require "fsdp.args"
local H = require "helpers"
local errors_with = H.assert_error_has

local decl = {
  description = "A test recipe.",
  {"steps", 200, "integer", "optimizer steps", min = 1},
  {"lr", 1e-3, "number", "learning rate", min = 0, max = 1},
  {"mp", nil, "string", "mixed precision", choices = {"bf16", "f16"}},
  {"resume", false, "boolean", "continue"},
  {"metrics", nil, "string", "JSONL file"},
  {"eval_every", 250, "integer", "validate every N steps"},
}
local spec = A.spec(decl)

local function parse(...) return A.parse(spec, {...}) end
local function refused(msg, ...)
  local v, err = parse(...)
  assert.is_nil(v)
  assert.equal(msg, err)
end

describe("fsdp.args parsing", function()
  it("fills in the defaults", function()
    assert.same({steps = 200, lr = 1e-3, resume = false, eval_every = 250}, parse())
  end)
  it("takes --name=value and --name value alike", function()
    assert.equal(50, parse("--steps=50").steps)
    assert.equal(50, parse("--steps", "50").steps)
    refused("--lr: -0.5 is below the minimum 0", "--lr", "-0.5")
    assert.equal("x.jsonl", parse("--metrics", "x.jsonl").metrics)
    assert.equal("", parse("--metrics=").metrics)
  end)
  it("reads booleans alone or with =true/=false", function()
    assert.is_true(parse("--resume").resume)
    assert.is_false(parse("--resume=false").resume)
    assert.is_true(parse("--resume=true").resume)
  end)
  it("takes - for _ in names; the last of repeated arguments wins", function()
    assert.equal(3, parse("--eval-every=3").eval_every)
    assert.equal(7, parse("--steps=5", "--steps=7").steps)
  end)
  it("refuses a value of the wrong type, naming the argument", function()
    refused("--steps: 'abc' is not an integer", "--steps=abc")
    refused("--steps: '1.5' is not an integer", "--steps", "1.5")
    -- past 2^53 the text would be read as a neighbouring integer
    local too_large = "is too large for an exact integer (its size must be below 2^53)"
    refused("--steps: '9007199254740993' " .. too_large, "--steps=9007199254740993")
    refused("--steps: '-1e20' " .. too_large, "--steps=-1e20")
    assert.equal(9007199254740991, parse("--steps=9007199254740991").steps)
    refused("--lr: 'fast' is not a number", "--lr=fast")
    refused("--lr: 'nan' is not a number", "--lr=nan")
    refused("--resume: 'yes' is not true or false", "--resume=yes")
  end)
  it("refuses values out of range or outside the choices", function()
    refused("--steps: 0 is below the minimum 1", "--steps=0")
    refused("--lr: 2 is above the maximum 1", "--lr=2")
    refused("--mp: 'f8' is not one of bf16, f16", "--mp=f8")
  end)
  it("refuses an unknown argument, suggesting the closest", function()
    refused("unknown argument --step; did you mean --steps?", "--step=50")
    refused("unknown argument --zzzzzz", "--zzzzzz")
  end)
  it("refuses a missing value", function()
    refused("--steps: missing value (--steps=INTEGER)", "--steps")
    refused("--metrics: missing value (--metrics=STRING)", "--metrics", "--steps=3")
  end)
  it("refuses words that are not arguments, also after --", function()
    refused("unexpected argument 'foo'; arguments are --name=value", "foo")
    refused("unexpected argument 'false'; arguments are --name=value", "--resume", "false")
    refused("unexpected argument 'x' after --", "--", "x")
    assert.equal(200, parse("--").steps)
  end)
  it("sees -h and --help before --", function()
    assert.is_true(A.wants_help({"--steps=abc", "--help"}))
    assert.is_true(A.wants_help({"-h"}))
    assert.is_false(A.wants_help({"--", "--help"}))
    assert.is_false(A.wants_help({"--steps=3"}))
  end)
end)

describe("fsdp.args help", function()
  it("lists every argument with its type, default and range", function()
    local h = A.help(spec, "fsdprun", "r.lua")
    assert.truthy(h:find("usage: fsdprun [-n N] r.lua [--name=value ...]", 1, true))
    assert.truthy(h:find("A test recipe.", 1, true))
    assert.truthy(h:find("--steps=INTEGER       optimizer steps [default 200, >= 1]", 1, true))
    assert.truthy(h:find("--lr=NUMBER           learning rate [default 0.001, 0..1]", 1, true))
    assert.truthy(h:find("--mp=bf16|f16         mixed precision\n", 1, true))
    assert.truthy(h:find("--resume              continue [default false]", 1, true))
    assert.truthy(h:find("-h, --help", 1, true))
  end)
end)

describe("fsdp.args declarations", function()
  it("refuses a malformed declaration at the recipe's line", function()
    errors_with(function() A.spec(3) end, "fsdp.args: expects a table of argument declarations (got number)")
    errors_with(function() A.spec{descripton = "x"} end, "fsdp.args: unknown key 'descripton'")
    errors_with(function() A.spec{"steps"} end, "fsdp.args: declaration 1 must be {name, default, type, help}")
    errors_with(function() A.spec{{"2x", 1, "integer", "h"}} end, "the name must be an identifier (got 2x)")
    errors_with(function() A.spec{{"s", 1, "int", "h"}} end,
      'fsdp.args: --s: the type must be "number", "integer", "string" or "boolean" (got int)')
    errors_with(function() A.spec{{"s", 1, "integer"}} end, "fsdp.args: --s: the help must be a string")
    errors_with(function() A.spec{{"s", 1, "integer", "h", mni = 0}} end, "fsdp.args: --s: unknown key 'mni'")
    errors_with(function() A.spec{{"s", 1, "integer", "h"}, {"s", 2, "integer", "h"}} end,
      "fsdp.args: --s: declared twice")
    errors_with(function() A.spec{{"help", false, "boolean", "h"}} end, "fsdp.args: --help: reserved")
    errors_with(function() A.spec{{"s", 1.5, "integer", "h"}} end, "fsdp.args: --s: the default 1.5 is not an integer")
    errors_with(function() A.spec{{"s", 0, "integer", "h", min = 1}} end,
      "fsdp.args: --s: the default 0 is below the minimum 1")
    errors_with(function() A.spec{{"s", "a", "string", "h", choices = {"b"}}} end,
      "fsdp.args: --s: the default 'a' is not one of b")
    errors_with(function() A.spec{{"s", 1, "integer", "h", choices = {"b"}}} end,
      "choices must be a list of strings, for a string argument")
    errors_with(function() A.spec{{"s", "a", "string", "h", min = 0}} end,
      "min must be a number, for a number or integer argument")
  end)
  it("names the spec line, not the library", function()
    local ok, err = pcall(A.spec, {{"s", 1, "int", "h"}})
    assert.is_false(ok)
    assert.falsy(err:find("args.lua", 1, true))
  end)
end)

describe("fsdp.args declared twice", function()
  it("refuses a second declaration, naming the first (it would refuse the first's arguments)", function()
    local fsdp = require "fsdp"
    local saved = rawget(_G, "arg")
    _G.arg = {[0] = "r.lua", "--steps=3"}
    local ok, err = pcall(function()
      local a = fsdp.parse_args({})
      a{{"steps", 1, "integer", "x"}}
      assert.equal(3, a.steps)
      errors_with(function() a{{"lr", 1, "number", "y"}} end,
        "fsdp.args: the arguments were already declared (at ", "args_spec.lua:",
        "declare every argument in one fsdp.args{...}")
      assert.equal(3, a.steps)
    end)
    _G.arg = saved
    assert(ok, err)
  end)
end)
