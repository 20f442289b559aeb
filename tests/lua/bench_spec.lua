-- bench_spec.lua — the measurement helpers bench/ scripts use from fsdp.core: clock,
-- sgemm_gflops (its arguments checked, the error naming them) and cpu_gemm_stats (the calling
-- thread's products through the cpu kernel table, counted by the ops that run them).
-- Run: busted --lua=luajit tests/lua/bench_spec.lua

local fsdp = require "fsdp"
local core = fsdp.core

describe("bench helpers", function()
  it("clock moves forward", function()
    local t0 = core.clock()
    assert.is_true(core.clock() >= t0)
  end)

  it("sgemm_gflops measures a rate and rejects bad arguments", function()
    local r = core.sgemm_gflops(32, 48, 16, 0.01)
    assert.is_true(r > 0 and r < 1e6)
    assert.is_true(core.sgemm_gflops(8, 8, 8) > 0) -- seconds default to 1
    local ok, err = pcall(core.sgemm_gflops, 0, 8, 8, 0.01)
    assert.is_false(ok)
    assert.truthy(err:find("sgemm_gflops: sizes must be positive (got 0 x 8 x 8)", 1, true))
    ok, err = pcall(core.sgemm_gflops, 8, 8, -3, 0.01)
    assert.is_false(ok)
    assert.truthy(err:find("got 8 x 8 x -3", 1, true))
    ok, err = pcall(core.sgemm_gflops, 8, 8, 8, 0)
    assert.is_false(ok)
    assert.truthy(err:find("sgemm_gflops: seconds must be positive (got 0)", 1, true))
    ok, err = pcall(core.sgemm_gflops, 8, 8, 8, 0 / 0)
    assert.is_false(ok)
    assert.truthy(err:find("seconds must be positive", 1, true))
  end)

  it("cpu_gemm_stats counts a linear's products on this thread", function()
    local x, w = fsdp.randn { 16, 8 }, fsdp.randn { 4, 8 }
    local s0 = core.cpu_gemm_stats()
    fsdp.nn.F.linear(x, w)
    local s1 = core.cpu_gemm_stats()
    assert.are.equal(1, s1.calls - s0.calls)
    assert.are.equal(2 * 16 * 4 * 8, s1.flops - s0.flops)
    assert.is_true(s1.seconds > s0.seconds)
  end)
end)
