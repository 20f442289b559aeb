-- fsdp.save / fsdp.load — collective, bounded-memory, atomic checkpoints.
-- docs/checkpoints.md is the manual and the format specification; the file formats
-- themselves (safetensors writer/reader with XXH3 checksums, atomic files, the index schema
-- check) are C: src/io, through fsdp.core (src/lua/l_io.c). This file is the API: options,
-- the choice of format, and applying a staged load; the formats are
-- lua/fsdp/checkpoint/safetensors.lua and sharded.lua, what they share (and the agreement
-- between ranks every step ends with) lua/fsdp/checkpoint/common.lua.
--
--   fsdp.save(model, path, {format = "safetensors" | "sharded", optimizer =, extra =,
--             loaders = {name = loader} | loader =, schedule =, step =})        -- collective
--   fsdp.load(model, path, {optimizer =, strict = true, loaders = | loader =, schedule =,
--             rng = true}) -> extra, info                                       -- collective
--
-- Two formats:
--   * "safetensors": one standard file of the full model. Rank 0 writes; every rank takes part
--     in gathering one unit at a time, so memory is the largest unit plus the writer's buffer.
--     A tied parameter is stored once (its other paths in __metadata__ "fsdp.tied.<alias>"),
--     masks as tensors "<path>:mask". Loading reads on every rank only its shard's ranges.
--   * "sharded": a folder with one safetensors file per rank (its slices of parameters,
--     optimizer state and masks) and index.json (checked in C: src/io/index.c), written last.
--     Loading computes, from the index, which ranges of which files hold this rank's slices,
--     so a checkpoint saved at W ranks loads at any world size (resharding).
--
-- Dtypes: every tensor is stored in its own dtype (parameters of a plain model in theirs, a
-- wrapped model's in its shards' (f32 masters), optimizer state in its own, tensors in extra
-- in theirs; masks as F32 0/1). Loading reads into buffers of the dtype the model (or the
-- optimizer) has, converting as it reads (fsdp.core's r:read(name, first, count, out)).
-- Tensors anywhere in extra are stored as tensors "fsdp.extra:<n>" (safetensors: in the file;
-- sharded: in rank 0's file, listed in the index's extra_tensors) and stand in the JSON of
-- extra as {"fsdp.tensor": "<name>"}.
--
-- Both first agree on what the options decide (agree_options: one all_reduce). Loading is
-- then two phases: stage (local, may fail: read and check everything this rank needs into new
-- tensors, and ask the optimizer, the schedule and set_rng_state whether they take what was
-- read), the ranks agree, then apply (nothing left that can fail on one rank alone). Saving
-- agrees before anything irreversible (the index commit).

local core = require "fsdp.core"
local hf = require "fsdp.hf"
local mask = require "fsdp.mask"
local meta = require "fsdp.meta"
local nn = require "fsdp.nn"
local wrap = require "fsdp.wrap"
local C = require "fsdp.checkpoint.common"
local collective = require "fsdp.collective"
local safetensors = require "fsdp.checkpoint.safetensors"
local sharded = require "fsdp.checkpoint.sharded"
local state = require "fsdp.state"
local ties = require "fsdp.ties"
local util = require "fsdp.util"

local raise = util.raise

local M = {}

-- The Root of a wrapped model, false for a plain one; an error for a module inside a
-- wrapped model.
local function check_model(fn, model)
  if not util.is_module(model) then
    util.raise(("%s: expected a module (got %s)"):format(fn, type(model)))
  end
  local R = state.of(model)
  if R ~= nil and R:model() ~= model then
    util.raise(("%s: this %s is part of a wrapped model: pass the wrapped root (a %s)")
      :format(fn, model:type_name(), R:model():type_name()))
  end
  return R or false
end

-- ---- options ------------------------------------------------------------------------------------

local SAVE_OPTS = {format = true, optimizer = true, extra = true, loaders = true, loader = true,
  schedule = true, step = true}
local LOAD_OPTS = {optimizer = true, strict = true, loaders = true, loader = true, schedule = true,
  rng = true, format = true}

local function check_opts(fn, model, opts, known)
  opts = util.check_opts(fn, opts, util.sorted_keys(known))
  local opt = opts.optimizer
  if opt ~= nil and (type(opt) ~= "table" or opt.export_slices == nil) then
    raise(fn .. ": optimizer must be an fsdp.optim optimizer")
  end
  if opt and opt.wrapped and opt.wrapped:model() ~= model then
    raise(fn .. ": the optimizer was made for another model")
  end
  local loaders = {}
  if opts.loader ~= nil then loaders.loader = opts.loader end
  if opts.loaders ~= nil then
    if type(opts.loaders) ~= "table" then raise(fn .. ": loaders must be a table {name = loader}") end
    for k, l in pairs(opts.loaders) do loaders[k] = l end
  end
  for k, l in pairs(loaders) do
    if type(k) ~= "string" or type(l) ~= "table" or type(l.cursor) ~= "number" then
      raise(("%s: loader %s must be a data loader (with a cursor field)"):format(fn, tostring(k)))
    end
  end
  local sc = opts.schedule
  if sc ~= nil and (type(sc) ~= "table" or type(sc.state_dict) ~= "function"
      or type(sc.load_state_dict) ~= "function") then
    raise(("%s: schedule must be a learning-rate schedule, one with state_dict and load_state_dict "
      .. "(fsdp.optim.cosine, linear, constant, step_lr, wsd or lambda; got %s)"):format(fn, type(sc)))
  end
  if opts.format ~= nil and opts.format ~= "safetensors" and opts.format ~= "sharded" then
    raise(("%s: format must be \"safetensors\" or \"sharded\" (got %s)"):format(fn, tostring(opts.format)))
  end
  return opts, loaders
end

-- What the options decide about the checkpoint, for the ranks to agree on (fsdp.save adds its
-- step and extra, fsdp.load its strict and rng): the format, the optimizer's kind, the loaders'
-- names and the schedule's kind (true for one without a kind).
local function options_summary(format, opts, loaders)
  local names = {}
  for k in pairs(loaders) do names[#names + 1] = k end
  table.sort(names)
  local sc, kind = opts.schedule, false
  if sc ~= nil then kind = type(sc.kind) == "string" and sc.kind or true end
  return {format = format, optimizer = opts.optimizer and opts.optimizer.kind or false,
    loaders = names, schedule = kind}
end

-- Collective. What a save or a load does is decided by every rank's options together, so the
-- ranks agree on them before anything is read or written: an optimizer (a loader, a
-- schedule...) given on one rank only would be saved or loaded there alone, and the ranks would
-- go on diverging. prepare() checks this rank's options and returns their summary (a plain
-- value), then whatever else it computed; summaries that differ raise on every rank, naming the
-- option and the ranks (fsdp.load: what to load differs across ranks at ["optimizer"]: rank 0
-- has "AdamW", rank 1 has false (ranks that differ from rank 0: 1)), and options refused on
-- one rank raise on every rank too ("rank R of W: <R's message>"). One all_reduce when they
-- agree.
local function agree_options(fn, what, prepare)
  local res = {pcall(prepare)}
  local err = not res[1] and res[2] or nil
  collective.agree(res[1] and res[2] or nil, fn .. ": what to " .. what, fn .. " options", err)
  return unpack(res, 3, table.maxn(res))
end

-- Phase A's end for the optimizer: the staged state as the list import_slices takes, checked
-- by the optimizer (its parameters, this rank's slices of them, frozen units' included) now,
-- while a refusal still fails every rank before anything is written.
local function stage_optimizer(plan, opt)
  local list = {}
  for _, x in ipairs(plan.items) do
    if x.optim then
      local tensors = {}
      for k, t in pairs(x.optim.tensors) do tensors[k] = t end
      list[#list + 1] = {param = x.it.param, path = x.it.path, first = x.optim.first,
        count = x.optim.count, scalars = x.optim.scalars, tensors = tensors}
    end
  end
  local why = opt:import_problem(list, "the optimizer's state")
  if why then C.fail(why) end
  plan.optim = list
end

-- ---- phase B: apply a staged plan (after every rank agreed) -------------------------------------------

-- Reshard every unit (collective, idempotent) so no gathered copy or prefetch outlives a change
-- of the shards ("none" too: one gathered in a mixed-precision dtype holds a copy).
local function reshard_all(R)
  for _, u in ipairs(R:units()) do u:reshard() end
end

local function apply_plan(model, plan, opts, loaders, parts, R)
  if R then reshard_all(R) end
  local loaded = {}
  util.no_grad(function()
    for _, x in ipairs(plan.items) do
      local p, part = x.it.param, parts[x.it.param]
      if part.meta and x.data then
        -- a plain parameter built on meta (fsdp.meta): dense storage now, in place
        core.param_materialize(p)
        part.view = p:detach():view{p:numel()}
      end
      if x.data and part.count > 0 then part.view:copy(x.data:view{part.count}) end
      loaded[#loaded + 1] = p
    end
  end)
  -- a model wrapped on meta: the loaded parameters stop being pending
  if R then R:given_values(loaded) end
  -- re-tie (plain models whose file says two paths are one parameter)
  for _, t in ipairs(plan.retie or {}) do ties.set_path(model, t.alias, t.target.param) end
  local set, any = {}, false
  for _, x in ipairs(plan.items) do
    if x.mask then set[x.it.param] = x.mask any = true end
  end
  if any then mask.set_local(model, set) end
  if plan.optim then
    local o = plan.index.optimizer
    -- the staged buffers are new and ours: the optimizer adopts them (no second copy); staging
    -- checked the list (import_problem), so this cannot refuse it after the parameters changed
    opts.optimizer:import_slices(plan.optim,
      {step = o.step, lr = o.lr, hyper = o.hyper, adopt = true})
  end
  if plan.index then
    for name, l in pairs(loaders) do l.cursor = plan.index.loaders[name] end
    -- checked while staging (load_problem), or loaded already
    if opts.schedule and not plan.schedule_loaded then
      opts.schedule:load_state_dict(plan.index.schedule)
    end
  end
  if plan.rng then core.set_rng_state(plan.rng) end
end

-- ---- the API ------------------------------------------------------------------------------------------

--- Collective. Save model (and optionally optimizer state, loader positions, a schedule, extra)
--- to path. format: "safetensors" (one file, rank 0 writes) or "sharded" (a folder); default:
--- "safetensors" when path ends in .safetensors, else "sharded".
function M.save(model, path, opts)
  local R = check_model("fsdp.save", model)
  if R then R:check_idle("fsdp.save") end
  if R and R:has_pending() then
    raise("fsdp.save: the model was wrapped on the meta device and some parameters have no "
      .. "values yet (fsdp.materialize or fsdp.load it first)")
  end
  if type(path) ~= "string" or path == "" then raise("fsdp.save: path must be a non-empty string") end
  local loaders, format
  local X = {tensors = {}} -- extra: its JSON (tensors as tags) and its tensors
  -- What the checkpoint holds is decided by every rank's options together (agree_options: an
  -- optimizer given on one rank only would be saved with the other ranks' state missing).
  opts, loaders, format = agree_options("fsdp.save", "save", function()
    local o, l = check_opts("fsdp.save", model, opts, SAVE_OPTS)
    local f = o.format or (path:match("%.safetensors$") and "safetensors" or "sharded")
    if o.step ~= nil and not util.is_int(o.step, 0) then
      raise("fsdp.save: step must be an integer >= 0")
    end
    if o.extra ~= nil then
      local ok, err = pcall(function() X.json, X.tensors = C.split_extra(o.extra) end)
      if ok then
        ok, err = pcall(core.json_encode, X.json)
        X.text = ok and err or nil
      end
      if not ok then
        local why = util.strip(err):gsub("^json_write: ", "")
        raise("fsdp.save: extra must be JSON-able values and tensors (" .. why .. ")")
      end
    end
    local summary = options_summary(f, o, l)
    summary.step, summary.extra = o.step or false, o.extra ~= nil
    return summary, o, l, f
  end)
  -- an nn.GPT's configuration, so fsdp.load_model can rebuild it without the recipe
  if model:type_name() == "GPT" and type(model.config) == "function" then X.config = model:config() end
  -- Both formats save the shards' values. A unit still gathered (after a forward whose
  -- backward has not run) holds a copy: resharded first, which refuses a parameter written in
  -- place while gathered (a change no shard holds) instead of saving one value or the other.
  if R then
    R:check_clean("fsdp.save")
    reshard_all(R)
  end
  if format == "safetensors" then
    if next(loaders) or opts.schedule then
      raise("fsdp.save: a safetensors file holds the model only; save loaders and schedules with format = \"sharded\"")
    end
    return safetensors.save(model, path, opts, R, X)
  end
  return sharded.save(model, path, opts, loaders, R, X)
end

--- Collective. Load path (a safetensors file or a sharded checkpoint folder) into model (and
--- optimizer, loaders, schedule, random state). Nothing changes unless every rank could read
--- and check everything it needs. Returns extra (or {}) and {format =, step =, world_size =}.
function M.load(model, path, opts)
  local R = check_model("fsdp.load", model)
  if R then R:check_idle("fsdp.load") end
  if type(path) ~= "string" or path == "" then raise("fsdp.load: path must be a non-empty string") end
  local loaders, format
  -- What is loaded is decided by every rank's options together (agree_options: an optimizer
  -- given on one rank only would be loaded there alone); agreed before anything is read.
  opts, loaders, format = agree_options("fsdp.load", "load", function()
    local o, l = check_opts("fsdp.load", model, opts, LOAD_OPTS)
    for _, k in ipairs{"strict", "rng"} do
      if o[k] ~= nil and type(o[k]) ~= "boolean" then
        raise(("fsdp.load: %s must be a boolean"):format(k))
      end
    end
    -- a regular file is a safetensors file; a folder a sharded checkpoint
    local f = o.format or (core.io_size(path) and "safetensors" or "sharded")
    if f == "safetensors" and (o.optimizer or next(l) or o.schedule) then
      raise("fsdp.load: a safetensors file holds the model only (optimizer, loaders and schedules "
        .. "come from sharded checkpoints)")
    end
    -- the format as given: one told from what path is on this rank's file system is checked
    -- while staging (a path missing on one rank fails there, naming the path)
    local summary = options_summary(o.format or false, o, l)
    summary.strict, summary.rng = o.strict ~= false, o.rng ~= false
    -- a schedule without load_problem costs the load one more agreement (below)
    local sc = o.schedule
    summary.schedule_load_problem = sc ~= nil and type(sc.load_problem) == "function"
    return summary, o, l, f
  end)
  local P = C.param_table(model)
  local parts, plan
  local ok, err = util.quiet(function()
    -- apply_plan reshards every unit first: one whose gathered copy changed outside
    -- full_params / apply (a change no shard holds) would be refused there on the ranks that
    -- made the change only, after the others loaded; refused here, where the ranks agree
    if R then
      for _, u in ipairs(R:units()) do
        if u:dirty() then error(state.changed_error(u.path), 0) end
      end
    end
    parts = C.local_parts(P, true)
    if format == "safetensors" then
      plan = safetensors.stage(path, opts, P, parts, R)
    else
      plan = sharded.stage(path, opts, loaders, P, parts, R)
    end
    if opts.optimizer and plan.index then stage_optimizer(plan, opts.optimizer) end
    -- a mask read from the file must be 0/1 before any weight changes (mask.set_local checks
    -- it again, after the weights are in)
    for _, x in ipairs(plan.items) do
      if x.mask ~= nil and x.mask:numel() > 0 then
        local bad = core.mask_check(x.mask)
        if bad > 0 then
          error(("%s: the mask of %s holds %d values other than 0 and 1"):format(path, x.it.path,
            bad), 0)
        end
      end
    end
  end)
  local msg = C.agree(ok, err)
  if msg then raise("fsdp.load: " .. msg) end
  -- A schedule that cannot tell beforehand whether it takes the saved state (a schedule of the
  -- user's own, without load_problem: staging could not ask it) takes it now, before anything
  -- else changes; the ranks agree on how that went, and if any refused, those that took it go
  -- back to the state they had.
  local sched = opts.schedule
  if sched and plan.index and type(sched.load_problem) ~= "function" then
    local before
    ok, err = pcall(function()
      before = sched:state_dict()
      local took, why = pcall(sched.load_state_dict, sched, plan.index.schedule)
      if not took then error(("%s: the schedule: %s"):format(path, util.message(why)), 0) end
    end)
    msg = C.agree(ok, err)
    if msg then
      if before ~= nil then pcall(sched.load_state_dict, sched, before) end
      raise("fsdp.load: " .. msg)
    end
    plan.schedule_loaded = true
  end
  apply_plan(model, plan, opts, loaders, parts, R)
  local info = {format = format}
  if plan.index then
    info.step, info.world_size, info.generation = plan.index.step, plan.index.world_size, plan.index.generation
  end
  return plan.extra or {}, info
end

local LOAD_MODEL_OPTS = {"wrap", "strict"}

-- The nn.GPT configuration stored with a checkpoint at path, or nil and why not.
local function stored_config(path)
  if core.io_size(path) then -- a safetensors file
    local r = core.st_open(path)
    local text = r:metadata()["fsdp.config"]
    -- export_hf's weights carry fsdp.config too, under GPT-2's names: their folder is the model
    local hf_names = false
    for _, e in ipairs(r:entries()) do
      if e.name == "transformer.wte.weight" then hf_names = true end
    end
    r:close()
    if hf_names then
      local folder = path:match("^(.*)/[^/]*$") or "."
      error(("%s holds a Hugging Face GPT-2's tensors (transformer.wte.weight, ...): give its "
        .. "folder, %s, which holds config.json as well (fsdp.import_hf reads it)")
        :format(path, folder), 0)
    end
    if text == nil then return nil, path .. " has no fsdp.config in its metadata" end
    return core.json_decode(text, path .. ": fsdp.config")
  end
  local ipath = C.path_join(C.strip_slashes(path), "index.json")
  if not core.io_size(ipath) then
    return nil, path .. " is no checkpoint (no such file, and no folder with index.json or config.json)"
  end
  local index = core.ckpt_index_read(ipath) -- checked (checksum, schema) before its config is used
  if type(index.config) ~= "table" then
    return nil, ipath .. " has no config"
  end
  return index.config
end

--- Collective when wrap is given. load_model(path [, {wrap =, strict = true}]) -> model,
--- extra, info: the nn.GPT a checkpoint holds, rebuilt from the configuration saved with it
--- (fsdp.save and fsdp.export_hf store GPT:config(); a Hugging Face GPT-2 folder's config.json
--- serves too), built on meta and filled by fsdp.load (or fsdp.import_hf for a folder with
--- config.json). wrap = fsdp.wrap's options: wrapped before loading, so each rank reads only
--- its shards.
function M.load_model(path, opts)
  opts = util.check_opts("fsdp.load_model", opts, LOAD_MODEL_OPTS)
  if type(path) ~= "string" or path == "" then raise("fsdp.load_model: path must be a non-empty string") end
  if opts.wrap ~= nil and type(opts.wrap) ~= "table" then
    raise("fsdp.load_model: wrap must be fsdp.wrap's options table")
  end
  if core.io_size(C.path_join(C.strip_slashes(path), "config.json")) then
    local model = hf.import_hf(path, {wrap = opts.wrap, strict = opts.strict})
    return model, {}, {format = "hf"}
  end
  local ok, cfg, why = pcall(stored_config, path)
  if not ok then raise("fsdp.load_model: " .. util.strip(cfg)) end
  if cfg == nil then
    raise(("fsdp.load_model: %s: build the model as the recipe does and fsdp.load it (checkpoints "
      .. "of an nn.GPT carry its configuration)"):format(why))
  end
  local built, model = pcall(meta.meta, function() return nn.GPT(cfg) end)
  if not built then raise("fsdp.load_model: " .. path .. ": the stored configuration: " .. util.strip(model)) end
  if opts.wrap then wrap.wrap(model, opts.wrap) end
  local loaded, extra, info = pcall(M.load, model, path, {strict = opts.strict})
  if not loaded then
    -- an adapted GPT saves its adapters under the base's configuration: strict = false would
    -- drop them and give the base model's output
    local msg = util.strip(extra)
    if msg:find("unexpected tensors", 1, true) and msg:find("%.lora%.[AB]") then
      raise(("fsdp.load_model: %s holds LoRA adapters, which an nn.GPT has no place for: merge "
        .. "them before saving (nn.lora.merge(model), after fsdp.unwrap on a wrapped model)"):format(path))
    end
    error(extra, 0)
  end
  -- strict = false skips what the model has no place for; parameters the file lacks would be
  -- left on meta, a model that cannot compute
  local R = state.of(model)
  local empty = {}
  if R then
    for _, e in ipairs(R:pending_list()) do empty[#empty + 1] = e.path end
  else
    for p_path, p in model:named_parameters() do
      if p.device == "meta" then empty[#empty + 1] = p_path end
    end
  end
  if #empty > 0 then
    raise(("fsdp.load_model: %s has no tensor for %s: the model would have no values there "
      .. "(strict = false skips tensors the model has no place for, not missing ones)")
      :format(path, util.few(empty)))
  end
  return model, extra, info
end

return M
