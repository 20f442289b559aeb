-- util_spec.lua — the shared helpers of lua/fsdp/util.lua that every options table goes through.
-- Run: busted --lua=luajit tests/lua/util_spec.lua
local U = require "fsdp.util"
local H = require "helpers"
local errors_with = H.assert_error_has

describe("util.check_opts", function()
  it("passes nil and known keys", function()
    assert.same({}, U.check_opts("f", nil, {"a", "b"}))
    local o = {a = 1}
    assert.equal(o, U.check_opts("f", o, {"a", "b"}))
  end)
  it("refuses an unknown key naming it, the function and the sorted valid keys", function()
    errors_with(function() U.check_opts("f", {wieght_decay = 1}, {"weight_decay", "lr"}) end,
      "f: unknown option 'wieght_decay' (valid: lr, weight_decay)")
  end)
  it("refuses a non-table", function()
    errors_with(function() U.check_opts("f", 3, {"a"}) end, "f: expects an options table {a} (got number)")
  end)
end)
