-- fsdp: the user-facing module. Tensors, autograd and kernels come from the C module
-- fsdp.core; seed and util (with log) load with this file, nn, optim, data and the other Lua
-- submodules on first use of one of their names.
--
-- No other library file requires "fsdp": each requires the lower files it uses (fsdp.core,
-- fsdp.seed, fsdp.util, ...), so loading one never loads this file (tests/lua/requires_spec.lua).

local core = require "fsdp.core"
local seed = require "fsdp.seed"
local util = require "fsdp.util"

local fsdp = {}

fsdp.core = core
fsdp.version = core.version
fsdp.Tensor = core.Tensor -- the tensor method table (add methods here from Lua)
fsdp.F = core.F

for _, name in ipairs { "tensor", "zeros", "ones", "full", "empty", "randn", "rand", "arange" } do
  fsdp[name] = core[name]
end
-- tensor functions that are also methods: fsdp.abs(t) is t:abs() (docs/tensor.md)
for _, name in ipairs { "abs", "sign", "where", "clamp", "cat", "stack", "max", "min", "argmax",
  "topk", "sort", "gt", "ge", "lt", "le", "eq", "ne" } do
  fsdp[name] = core[name]
end

-- ranks ------------------------------------------------------------------------------------
-- C-backed (src/lua/l_comm.c) on the calling thread's communicator: the rank's under
-- `fsdprun -n N`, a world of one elsewhere. The collectives are called directly (no Lua
-- wrapper) so that an error names the recipe line that made the call.
fsdp.rank = core.rank             -- 0-based
fsdp.world_size = core.world_size
fsdp.backend = core.backend       -- "local" (threads of one process) | "mpi" | "nccl"
--- Collective. Returns when every rank has called it. barrier(label?)
fsdp.barrier = core.barrier
--- Collective. all_reduce(x, op = "sum" | "mean" | "max" | "min", label?): a number (or an
--- array of numbers) gives the reduced number (array), reduced as f64, the same bits on every
--- rank; a contiguous tensor is reduced in place, in its dtype, and returned. Lua values other
--- than numbers travel with require "fsdp.collective".
fsdp.all_reduce = core.all_reduce
--- Collective. broadcast(x, root = 0, label?): rank root's number (f64: exact), or its
--- tensor's values copied in place into x on every rank.
fsdp.broadcast = core.broadcast
--- This rank's traffic counters: {<op>_bytes =, <op>_calls = for all_gather, reduce_scatter,
--- all_reduce, broadcast, barrier; calls = total; busy_s =, wait_s =}; tostring() prints a
--- table of them (lua/fsdp/inspect.lua).
function fsdp.comm_stats() return require("fsdp.inspect").comm_report(core.comm_stats()) end
fsdp.reset_comm_stats = core.reset_comm_stats
--- debug_on_error(on) -> the previous setting: when a rank raises, fsdprun opens the REPL
--- where every rank stopped instead of ending the run (fsdprun --debug-on-error; docs/REPL.md).
--- Every rank should call it alike. Outside fsdprun it does nothing and returns false.
function fsdp.debug_on_error(on)
  local host = package.loaded.fsdprun
  if type(host) ~= "table" or not host.debug_on_error then return false end
  return host.debug_on_error(on)
end

-- seeds and autograd ------------------------------------------------------------------------
-- manual_seed(n): same seed => same values on every rank; also restarts nn's count of
-- outermost module constructions (docs/nn.md, "Initialisation"). seed(): the seed in force.
-- seed_epoch(): how many times manual_seed has run. All three live in lua/fsdp/seed.lua.
for _, name in ipairs { "manual_seed", "seed", "seed_epoch" } do
  fsdp[name] = seed[name]
end
fsdp.is_grad_enabled = core.is_grad_enabled

--- Run fn(...) with gradient recording off; returns fn's results. The previous mode comes
--- back even when fn raises.
fsdp.no_grad = util.no_grad

-- devices and modes -------------------------------------------------------------------------
--- device_count(name) -> how many physical devices of that kind this machine has (0 when the
--- build or the machine has none: fsdp.device_count("cuda")).
fsdp.device_count = core.device_count
--- deterministic(on) -> previous: every kernel bitwise repeatable (no atomics in reductions) on
--- every device; without an argument, the current setting. The cpu always is.
fsdp.deterministic = core.deterministic

--- info() -> what this build runs on: version, devices (name, count, kernels, description),
--- the processor's vector features and the instruction set of the element-wise kernels (cpu.isa:
--- "avx512", "avx2" or "scalar"; FSDP_CPU_ISA forces one), the calling rank's cpu threads,
--- deterministic mode.
--- tostring() prints it.
function fsdp.info()
  local info = {version = core.version, devices = core.devices(), cpu = core.cpu_features(),
    threads = core.get_threads(), deterministic = core.deterministic()}
  return setmetatable(info, {__tostring = function(t)
    local lines = {("fsdprun %s"):format(t.version)}
    for _, d in ipairs(t.devices) do
      lines[#lines + 1] = ("  device %-6s count %d%s%s"):format(d.name, d.count,
        d.kernels and ", kernels" or (d.has_data and ", no kernels" or ", shape only"),
        d.description and (": " .. d.description) or "")
    end
    local feats = {}
    for _, k in ipairs{"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512bf16"} do
      if t.cpu[k] then feats[#feats + 1] = k end
    end
    lines[#lines + 1] = "  cpu    " .. (#feats > 0 and table.concat(feats, " ") or "baseline x86-64")
      .. ", kernels " .. t.cpu.isa
    lines[#lines + 1] = ("  threads %d, deterministic %s"):format(t.threads, tostring(t.deterministic))
    return table.concat(lines, "\n")
  end})
end

-- memory ------------------------------------------------------------------------------------
--- Live bytes by role on the cpu device, with peaks; `devices` holds every device's table.
--- tostring() prints them readably (lua/fsdp/inspect.lua).
function fsdp.memory()
  local m = core.memory()
  local cpu = m.cpu or {}
  return require("fsdp.inspect").memory_report {
    live = cpu.live or 0, peak = cpu.peak or 0,
    params = cpu.params or 0, grads = cpu.grads or 0, optim = cpu.optim or 0,
    gathered = cpu.gathered or 0, activations = cpu.activations or 0, other = cpu.other or 0,
    devices = m,
  }
end

-- recipe arguments: --key=value (numbers and true/false converted), --flag (true) -------------
-- fsdp.args holds them parsed loosely (no check) until the recipe declares its arguments:
-- fsdp.args{ {name, default, type, help}, ... } (lua/fsdp/args.lua) parses the global `arg`
-- against the declaration, refusing what does not fit it, and returns fsdp.args holding exactly
-- the values. parse_args gives such a table (an embedding host sets fsdp.args with it).
local declared_at = setmetatable({}, {__mode = "k"}) -- args table -> where it was declared
local args_mt = {
  __call = function(self, decl)
    -- a second declaration would replace the first, which then refuses the second's arguments
    if declared_at[self] then
      util.raise(("fsdp.args: the arguments were already declared (%s); declare every argument "
        .. "in one fsdp.args{...}"):format(declared_at[self]))
    end
    local vals = require("fsdp.args").declare(decl, core.rank())
    local where = util.user_where():gsub(": $", "")
    declared_at[self] = where ~= "" and "at " .. where or "earlier"
    for k in pairs(self) do self[k] = nil end
    for k, v in pairs(vals) do self[k] = v end
    return self
  end,
}
local function parse_args(argv)
  local args = {}
  for i = 1, #(argv or {}) do
    local a = argv[i]
    local k, v = tostring(a):match("^%-%-([%w_%-%.]+)=(.*)$")
    if k then
      if v == "true" then v = true elseif v == "false" then v = false
      else v = tonumber(v) or v end
      args[k] = v
    else
      local flag = tostring(a):match("^%-%-([%w_%-%.]+)$")
      if flag then args[flag] = true else args[#args + 1] = a end
    end
  end
  return setmetatable(args, args_mt)
end
fsdp.parse_args = parse_args
fsdp.args = parse_args(rawget(_G, "arg"))

-- submodules, loaded on first use ------------------------------------------------------------
local wrap_names = {
  wrap = true, unwrap = true, is_wrapped = true, units = true, apply = true, full_params = true,
  policy = true, shard = true,
}
-- names that live in other library files, resolved on first use
local other_names = {
  set_mask = "fsdp.mask", mask = "fsdp.mask", sparsity = "fsdp.mask",
  save = "fsdp.checkpoint", load = "fsdp.checkpoint", load_model = "fsdp.checkpoint",
  meta = "fsdp.meta", materialize = "fsdp.meta", ties = "fsdp.ties", retie = "fsdp.ties",
  inspect = "fsdp.inspect", debug = "fsdp.repl",
  no_sync = "fsdp.no_sync",
  export_hf = "fsdp.hf", import_hf = "fsdp.hf",
}
-- submodules that are fsdp fields themselves
local lazy = {
  nn = "fsdp.nn", optim = "fsdp.optim", data = "fsdp.data", log = "fsdp.log",
  plot = "fsdp.plot", prune = "fsdp.prune",
}
-- fsdp.tokenizer: SentencePiece tokenizers and token datasets (lua/fsdp/tokenizer.lua)
lazy.tokenizer = "fsdp.tokenizer"
setmetatable(fsdp, {
  -- the names resolved on first use, for the REPL's tab completion (lua/fsdp/repl.lua)
  __complete = function()
    local names = { "clip_grad_norm" }
    for _, set in ipairs { lazy, other_names, wrap_names } do
      for k in pairs(set) do names[#names + 1] = k end
    end
    return names
  end,
  __index = function(t, k)
    if lazy[k] then
      local m = require(lazy[k])
      rawset(t, k, m)
      return m
    end
    if k == "clip_grad_norm" then
      local f = t.optim.clip_grad_norm
      rawset(t, k, f)
      return f
    end
    if other_names[k] then
      local v = require(other_names[k])[k]
      rawset(t, k, v)
      return v
    end
    -- the sharding layer (lua/fsdp/wrap.lua): fsdp.wrap, unwrap, is_wrapped, units, apply,
    -- full_params, policy, shard
    if wrap_names[k] then
      local v = require("fsdp.wrap")[k]
      rawset(t, k, v)
      return v
    end
  end,
})

return fsdp
