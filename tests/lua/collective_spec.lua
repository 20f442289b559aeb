-- collective_spec.lua — fsdp.collective on a world of one: the canonical encoding (every kind
-- of value round-trips, numbers bit for bit, table order does not matter, what cannot travel is
-- refused naming where it is), and all_gather / broadcast / compare / agree of one rank.
-- tests/dist/collective.lua runs the same module on several ranks.
-- Run: busted --lua=luajit tests/lua/collective_spec.lua

local fsdp = require "fsdp"
local collective = require "fsdp.collective"
local core = fsdp.core

-- deep equality with NaN equal to NaN and -0 different from +0
local function same(a, b)
  if type(a) ~= type(b) then return false end
  if type(a) == "number" then
    if a ~= a then return b ~= b end
    return a == b and 1 / a == 1 / b
  end
  if type(a) ~= "table" then return a == b end
  for k, v in pairs(a) do if not same(v, b[k]) then return false end end
  for k in pairs(b) do if a[k] == nil then return false end end
  return true
end

describe("fsdp.collective encoding", function()
  it("round-trips every kind of value", function()
    local long = ("0123456789\0"):rep(100000) -- 1.1 MB with NUL bytes
    local values = {
      nil, true, false, 0, -0.0, 1, -1, 0.1, 1 / 3, 2 ^ 53 + 2, -2 ^ 60, 1e308, 5e-324, math.huge,
      -math.huge, 0 / 0, "", "a\0b\0", "\n\r\t\"\\", long,
      {}, {1, 2, 3}, {a = {b = {c = {"deep", {true}}}}}, {[1] = "x", [3] = "hole", [0.5] = 1,
      [-1] = false, [true] = "t", [false] = "f", [""] = 0, ["1"] = "string one"},
    }
    for i = 1, 24 do
      local v = values[i]
      local back = collective.decode(collective.encode(v))
      assert.is_true(same(v, back), ("value %d: %s"):format(i, collective.show(v)))
    end
  end)

  it("encodes equal tables to equal bytes whatever the insertion order", function()
    local a, b = {}, {}
    for i = 1, 50 do a["k" .. i] = i; a[i] = -i end
    for i = 50, 1, -1 do b[i] = -i; b["k" .. i] = i end
    assert.are.equal(collective.encode(a), collective.encode(b))
    assert.are_not.equal(collective.encode({1, 2}), collective.encode({2, 1}))
    assert.are_not.equal(collective.encode("1"), collective.encode(1))
  end)

  it("refuses what cannot travel, naming where it is", function()
    local function err(v)
      local ok, e = pcall(collective.encode, v)
      assert.is_false(ok)
      return tostring(e)
    end
    assert.truthy(err({cfg = {fn = print}}):find('cannot send ["cfg"]["fn"]: it is a function', 1, true))
    assert.truthy(err(fsdp.zeros{2}):find("cannot send the value: it is a userdata", 1, true))
    local t = {x = {}}
    t.x.back = t
    assert.truthy(err(t):find('["x"]["back"] is a cycle', 1, true))
    assert.truthy(err({[{}] = 1}):find("has a key of type table", 1, true))
    -- a table used twice without a cycle is fine
    local shared = {1}
    assert.is_true(same(collective.decode(collective.encode({shared, shared})), {{1}, {1}}))
  end)

  it("refuses malformed bytes", function()
    for _, bad in ipairs{"", "q", "s5:ab", "n1", "t1:n1;", "TT"} do
      assert.is_false(pcall(collective.decode, bad), bad)
    end
  end)
end)

describe("fsdp.collective on a world of one", function()
  it("gathers, broadcasts and agrees with itself", function()
    local v = {s = "a\0b", n = {1.5, 2 ^ 60}}
    local all = collective.all_gather(v)
    assert.are.equal(1, #all)
    assert.is_true(same(all[1], v))
    assert.are.equal("x\0y", collective.broadcast("x\0y", 0))
    assert.is_true(same(collective.broadcast(v), v))
    assert.are.equal(v, collective.agree(v, "the config"))
    assert.is_nil(collective.compare(v))
    assert.is_true(same(collective.compare(v, "broke"), {failed = 0, err = "broke"}))
    assert.has_error(function() collective.agree(1) end,
      "collective.agree: `what` must be a string naming the value")
  end)

  it("moves strings as bytes through the binding", function()
    local s = ("\0\255x"):rep(1000)
    assert.are.same({s}, core.all_gather_bytes(s))
    assert.are.same({""}, core.all_gather_bytes(""))
    assert.are.equal(s, core.broadcast_bytes(s, 0))
    local h1, h2 = core.bytes_digest("abc")
    assert.is_true(h1 >= 0 and h1 < 2 ^ 32 and h2 >= 0 and h2 < 2 ^ 32)
    assert.are_not.same({h1, h2}, {core.bytes_digest("abd")})
    assert.has_error(function() core.broadcast_bytes(12, 0) end,
      "broadcast_bytes: expected a string, got number")
    assert.has_error(function() core.all_gather_bytes(12) end,
      "all_gather_bytes: expected a string, got number")
    assert.has_error(function() core.broadcast_bytes("x", 1) end,
      "broadcast_bytes: root 1 is not a rank in [0, 1)")
    assert.has_error(function() core.broadcast_bytes("x", "0") end,
      "broadcast_bytes: root must be a rank number, got string")
  end)
end)
