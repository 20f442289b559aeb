-- fsdp.checkpoint.sharded — a folder with one safetensors file per rank and index.json
-- (docs/checkpoints.md, "The sharded format").
--
--   S.save(model, dir, opts, loaders, R, X)       collective: every rank writes its file,
--                                                 rank 0 commits the index last
--   S.stage(dir, opts, loaders, P, parts, R)      local: this rank's part of everything
--   S.before_index                                nil, or a function run just before the
--                                                 index is written (tests arm faults there)
--
-- Each file holds its rank's slices of parameters, optimizer state and masks; the index
-- (checked in C: src/io/index.c) says which rank saved which elements, so loading computes
-- which ranges of which files hold this rank's slices and a checkpoint saved at W ranks loads
-- at any world size (resharding). Files carry a generation number: a save writes generation
-- g + 1 beside g and removes the old files only once the new index is committed.

local core = require "fsdp.core"
local mask = require "fsdp.mask"
local C = require "fsdp.checkpoint.common"
local util = require "fsdp.util"

local S = {}

local INDEX = "index.json"
local FORMAT_TAG = "fsdprun.sharded" -- FSDP_IO_INDEX_FORMAT
local FILE_PATTERN = "^g(%d+)%-rank(%d+)%-of(%d+)%.safetensors$"
local MASK_SUFFIX, fail, shape_str, sorted_keys = C.MASK_SUFFIX, C.fail, util.shape_str, util.sorted_keys

local function file_name(gen, r, W) return ("g%d-rank%d-of%d.safetensors"):format(gen, r, W) end

-- rank 0: the next generation number: above every generation in the folder (files and index)
local function next_generation(dir)
  local gen = 0
  local ok, idx = pcall(core.json_read, C.path_join(dir, INDEX))
  if ok and type(idx) == "table" and type(idx.generation) == "number" then gen = idx.generation end
  for _, name in ipairs(core.io_listdir(dir)) do
    local g = name:match(FILE_PATTERN)
    if g and tonumber(g) > gen then gen = tonumber(g) end
  end
  return gen + 1
end

-- The even split of n elements over W ranks (for parameters every rank holds whole):
-- rank r saves [r*chunk, min(n, (r+1)*chunk)).
local function even_slice(n, W, r)
  local chunk = math.ceil(n / W)
  local first = r * chunk
  local count = math.max(0, math.min(chunk, n - first))
  return first, count
end

-- Which elements of each parameter each rank saves: {[p] = {{rank =, first =, count =}, ...}
-- sorted by first}. Sharded units: the unit layout's slices (every rank's, from this rank's
-- view of the layout); replicated parameters: the even split.
local function save_slices(P, parts)
  local W = core.world_size()
  local layouts = {}
  local out = {}
  for _, it in ipairs(P.list) do
    local p, part = it.param, parts[it.param]
    local sl = {}
    if part.replicated then
      for r = 0, W - 1 do
        local first, count = even_slice(p:numel(), W, r)
        if count > 0 then sl[#sl + 1] = {rank = r, first = first, count = count} end
      end
    else
      local u = part.unit
      local lay = layouts[u]
      if lay == nil then
        lay = {}
        local paths, params = u:paths(), u:params()
        local path_of = {}
        for i = 1, #params do path_of[paths[i]] = params[i] end
        for _, l in ipairs(u:layout()) do lay[path_of[l.path] or l.path] = l end
        layouts[u] = lay
      end
      local l = lay[p]
      for r = 0, W - 1 do
        local s = l and l.slices[r]
        if s then sl[#sl + 1] = {rank = r, first = s[1] - 1, count = s[2] - s[1] + 1} end
      end
      table.sort(sl, function(a, b) return a.first < b.first end)
    end
    out[p] = sl
  end
  return out
end

-- This rank's optimizer state, keyed by parameter: {scalars =, tensors =, first =, count =}.
local function optimizer_state(opt, P)
  local out = {}
  for _, s in ipairs(opt:export_slices()) do
    if P.by_param[s.param] == nil then
      fail(("the optimizer updates a parameter (%s) that is not part of this model"):format(s.path))
    end
    out[s.param] = s
  end
  return out
end

-- What this rank's file holds: the entries and the writes {name, tensor}, optimizer scalars by
-- path and the names of the optimizer's state tensors.
local function file_contents(P, parts, slices, ostate, has_mask, X)
  local rank = core.rank()
  local entries, writes, scalars, state_names = {}, {}, {}, {}
  local function add(name, shape, dtype, t)
    entries[#entries + 1] = {name = name, shape = shape, dtype = dtype}
    writes[#writes + 1] = {name, t}
  end
  for _, it in ipairs(P.list) do
    local p, part = it.param, parts[it.param]
    local mine
    for _, s in ipairs(slices[p]) do if s.rank == rank then mine = s end end
    if mine then
      local off = mine.first - part.first -- within this rank's part (0 unless replicated)
      add(it.path, {mine.count}, part.dtype, part.view:narrow(1, off + 1, mine.count))
      local st = ostate and ostate[p]
      if st then
        local soff = mine.first - st.first
        if soff < 0 or soff + mine.count > st.count then
          fail(("optimizer state of %s covers elements [%d, %d), not this rank's [%d, %d)")
            :format(it.path, st.first, st.first + st.count, mine.first, mine.first + mine.count))
        end
        for _, name in ipairs(sorted_keys(st.tensors)) do
          add(it.path .. ":" .. name, {mine.count}, st.tensors[name]:dtype(),
            st.tensors[name]:narrow(1, soff + 1, mine.count))
          state_names[name] = true
        end
        scalars[it.path] = st.scalars
      end
      if has_mask[p] then
        local m = mask.local_slice(p)
        if m == nil or m:numel() ~= part.count then
          fail(("mask of %s: expected this rank's %d elements"):format(it.path, part.count))
        end
        add(it.path .. MASK_SUFFIX, {mine.count}, "F32", m:view{part.count}:narrow(1, off + 1, mine.count))
      end
    end
  end
  if rank == 0 then -- extra's tensors, whole, in rank 0's file
    for _, x in ipairs(X.tensors) do add(x.name, x.tensor:shape(), x.tensor:dtype(), x.tensor) end
  end
  return entries, writes, scalars, sorted_keys(state_names)
end

-- The index rank 0 commits, from every rank's report `all`.
local function index_of(P, parts, slices, has_mask, all, gen, opts, loaders, X)
  local opt = opts.optimizer
  local files, rng, states = {}, {}, {}
  for i, a in ipairs(all) do
    files[i] = {rank = i - 1, name = a.file.name, bytes = a.file.bytes, header_xxh3 = a.file.header_xxh3}
    rng[i] = a.rng
    for _, n in ipairs(a.file.states or {}) do states[n] = true end
  end
  local params = {}
  for _, it in ipairs(P.list) do
    local e = {path = it.path, shape = it.param:shape(), numel = it.param:numel(),
      dtype = C.ST_DTYPE[parts[it.param].dtype], slices = slices[it.param]}
    if #it.aliases > 0 then e.aliases = it.aliases end
    if has_mask[it.param] then e.mask = true end
    params[#params + 1] = e
  end
  local index = {format = FORMAT_TAG, version = 2, generation = gen, world_size = #all,
    step = opts.step or (opt and opt.step_count) or 0, files = files, params = params, rng = rng}
  if opt then
    index.optimizer = {kind = opt.kind, step = opt.step_count, lr = opt.lr, hyper = opt:hyper(),
      states = sorted_keys(states)}
  end
  if next(loaders) then
    index.loaders = {}
    for k, l in pairs(loaders) do index.loaders[k] = l.cursor end
  end
  if opts.schedule then index.schedule = opts.schedule:state_dict() end
  if X.json ~= nil then index.extra = X.json end
  if X.config ~= nil then index.config = X.config end
  if #X.tensors > 0 then
    index.extra_tensors = {}
    for i, x in ipairs(X.tensors) do
      index.extra_tensors[i] = {name = x.name, dtype = C.st_dtype(x.tensor), shape = x.tensor:shape()}
    end
  end
  return index
end

-- The index holds one position per loader, rank 0's, which every rank resumes from: loaders
-- that have served different numbers of batches on different ranks (a loop that skipped a step
-- on one rank) would resume in step where they ran apart. nil when they agree, else the error.
local function cursors_apart(all, W)
  local names = {}
  for name in pairs(all[1].cursors) do names[#names + 1] = name end
  table.sort(names)
  for _, name in ipairs(names) do
    local c0, apart = all[1].cursors[name], {}
    for i = 2, W do
      local c = all[i].cursors[name]
      if c ~= c0 then apart[#apart + 1] = ("%s on rank %d"):format(tostring(c), i - 1) end
    end
    if #apart > 0 then
      return ("data loader '%s' has served %s batches on rank 0 but %s: the checkpoint holds one "
        .. "position, which every rank resumes from; save where every rank's loader has served "
        .. "the same batches"):format(name, tostring(c0), table.concat(apart, ", "))
    end
  end
  return nil
end

--- Collective. Save model (R: its Root, false when plain) to the folder dir; loaders: {name =
--- loader}; X: extra's JSON and tensors.
function S.save(model, dir, opts, loaders, R, X)
  local W, rank = core.world_size(), core.rank()
  dir = C.strip_slashes(dir)
  local P = C.param_table(model)
  local opt = opts.optimizer
  local parts, slices, ostate
  -- local preparation (nothing collective, nothing written); then agree
  local ok, err = util.quiet(function()
    parts = C.local_parts(P)
    slices = save_slices(P, parts)
    if opt then ostate = optimizer_state(opt, P) end
  end)
  local msg = C.agree(ok, err)
  if msg then util.raise("fsdp.save: " .. msg) end
  local has_mask = {}
  for _, it in ipairs(P.list) do
    if mask.has(it.param) then has_mask[it.param] = true end
  end

  -- the generation (rank 0 looks at the folder), broadcast
  local gen = 0
  ok, err = true, nil
  if rank == 0 then
    ok, err = pcall(function()
      core.io_mkdirs(dir)
      gen = next_generation(dir)
    end)
  end
  msg = C.agree(ok, err)
  if msg then util.raise("fsdp.save: " .. msg) end
  gen = core.broadcast(gen, 0, C.LABEL)

  -- every rank writes its file
  local my_name = file_name(gen, rank, W)
  local my_path = C.path_join(dir, my_name)
  local info = {}
  ok, err = util.quiet(function()
    local entries, writes, scalars, states = file_contents(P, parts, slices, ostate, has_mask, X)
    local meta = {
      ["fsdp.checkpoint"] = core.json_encode({rank = rank, world_size = W, generation = gen}),
      ["fsdp.optim"] = core.json_encode({params = scalars}),
    }
    local w = core.st_writer(my_path, entries, meta)
    local wok, werr = pcall(function()
      for _, wr in ipairs(writes) do w:write(wr[1], wr[2]) end
      w:commit()
    end)
    if not wok then
      w:abort()
      error(werr, 0)
    end
    local bytes = assert(core.io_size(my_path))
    local r = core.st_open(my_path)
    local hx = r:metadata()["fsdp.header.xxh3_64"]
    r:close()
    info = {name = my_name, bytes = bytes, header_xxh3 = hx, states = states}
  end)
  -- agreement before the index commit: every rank's outcome, file, random state and loader
  -- positions
  local cursors = {}
  for name, l in pairs(loaders) do cursors[name] = l.cursor end
  local all = C.allgather({ok = ok, err = ok and "" or util.strip(err), file = info,
    rng = core.rng_state(), cursors = cursors})
  local failed
  for i, a in ipairs(all) do
    if not a.ok and failed == nil then failed = ("rank %d of %d: %s"):format(i - 1, W, a.err) end
  end
  if W == 1 and failed then failed = all[1].err end
  if not failed then failed = cursors_apart(all, W) end
  local function drop_mine() pcall(core.io_remove, my_path) end
  if failed then
    drop_mine()
    util.raise("fsdp.save: " .. failed)
  end

  -- rank 0 commits the index
  ok, err = true, nil
  if rank == 0 then
    ok, err = pcall(function()
      local index = index_of(P, parts, slices, has_mask, all, gen, opts, loaders, X)
      if S.before_index then S.before_index() end
      core.ckpt_index_write(C.path_join(dir, INDEX), index)
    end)
  end
  msg = C.agree(ok, err)
  if msg then
    -- the new files go, unless the index on disk names them after all (the one failure after
    -- the rename: the fsync of the folder); rank 0 looks, everyone follows
    local committed = 0
    if rank == 0 then
      local rok, idx = pcall(core.json_read, C.path_join(dir, INDEX))
      if rok and type(idx) == "table" and idx.generation == gen then committed = 1 end
    end
    if core.broadcast(committed, 0, C.LABEL) == 0 then drop_mine() end
    util.raise("fsdp.save: " .. msg)
  end
  -- committed: rank 0 removes the files of other generations (best effort)
  if rank == 0 then
    pcall(function()
      local keep = {}
      for _, a in ipairs(all) do keep[a.file.name] = true end
      for _, name in ipairs(core.io_listdir(dir)) do
        if name:match(FILE_PATTERN) and not keep[name] then core.io_remove(C.path_join(dir, name)) end
      end
      core.io_fsync_dir(dir)
    end)
  end
end

-- ---- load ------------------------------------------------------------------------------------

-- The files of a checkpoint this rank reads, each opened once and checked to be the one the
-- index names. files(r, needed_for) -> {r = reader, path =, entries =, verified =}; also the
-- optimizer scalars of each file (scalars_of[r]) and close().
local function file_set(dir, ipath, index)
  local readers, scalars_of = {}, {}
  local F = {scalars_of = scalars_of}
  function F.get(r, needed_for)
    if readers[r] then return readers[r] end
    local f = index.files[r + 1]
    local fpath = C.path_join(dir, f.name)
    local size, serr = core.io_size(fpath)
    if size == nil then
      fail(("%s names %s (rank %d's file, holding tensor '%s' among others), which cannot be "
        .. "read: %s"):format(ipath, f.name, r, needed_for or "?", serr))
    end
    local okr, rd = pcall(core.st_open, fpath)
    if not okr then fail(("%s (needed for tensor '%s')"):format(util.strip(rd), needed_for or "?")) end
    local meta = rd:metadata()
    if size ~= f.bytes or meta["fsdp.header.xxh3_64"] ~= f.header_xxh3 then
      fail(("%s: %d bytes, header checksum %s; the index (%s) expects %d bytes, %s: this file is "
        .. "not the one the index was written with"):format(fpath, size, tostring(meta["fsdp.header.xxh3_64"]),
        ipath, f.bytes, f.header_xxh3))
    end
    local ck = meta["fsdp.checkpoint"] and core.json_decode(meta["fsdp.checkpoint"], fpath .. ": fsdp.checkpoint")
    if type(ck) ~= "table" or ck.rank ~= r or ck.world_size ~= index.world_size or ck.generation ~= index.generation then
      fail(("%s: not rank %d's file of generation %d of this checkpoint"):format(fpath, r, index.generation))
    end
    local oj = meta["fsdp.optim"] and core.json_decode(meta["fsdp.optim"], fpath .. ": fsdp.optim")
    scalars_of[r] = (type(oj) == "table" and oj.params) or {}
    local ents = {}
    for _, e in ipairs(rd:entries()) do ents[e.name] = e end
    readers[r] = {r = rd, path = fpath, entries = ents, verified = {}}
    return readers[r]
  end
  function F.close()
    for _, R in pairs(readers) do R.r:close() end
  end
  return F
end

-- The pieces of the saved slices of index entry e that make up elements [a, a + n).
local function pieces_of(e, a, n)
  local pieces = {}
  for _, s in ipairs(e.slices) do
    local lo, hi = math.max(a, s.first), math.min(a + n, s.first + s.count)
    if lo < hi then
      pieces[#pieces + 1] = {rank = s.rank, s = s, src_off = lo - s.first, dst_off = lo - a, n = hi - lo}
    end
  end
  return pieces
end

-- The checks of the index against the model and options: which entry each parameter loads
-- from, the tied copies saved separately, missing and unexpected names, re-ties.
local function match_index(ipath, index, opts, P, R)
  local plan = {items = {}, index = index, retie = {}}
  local entry_of, own, used = {}, {}, {}
  for _, e in ipairs(index.params) do
    entry_of[e.path] = e
    own[e.path] = e
  end
  for _, e in ipairs(index.params) do
    for _, a in ipairs(e.aliases or {}) do entry_of[a] = entry_of[a] or e end
  end
  local function check_shape(e, it)
    if not C.same_shape(e.shape or {}, it.param:shape()) then
      fail(("%s: tensor '%s': shape %s in the checkpoint, %s in the model (parameter %s)")
        :format(ipath, e.path, shape_str(e.shape or {}), shape_str(it.param:shape()), it.path))
    end
  end
  local missing = {}
  for _, it in ipairs(P.list) do
    local e = entry_of[it.path]
    if e == nil then
      for _, a in ipairs(it.aliases) do e = e or entry_of[a] end
    end
    if e == nil then
      missing[#missing + 1] = it.path
    else
      check_shape(e, it)
      used[e.path] = true
      local x = {it = it, e = e, copies = {}}
      plan.items[#plan.items + 1] = x
      -- a tied parameter's other paths saved separately (from an untied model): they must
      -- hold the same values (checked as they are read)
      for _, a in ipairs(it.aliases) do
        if own[a] and own[a] ~= e then
          check_shape(own[a], it)
          used[a] = true
          x.copies[#x.copies + 1] = own[a]
        end
      end
    end
  end
  -- a plain model untied where the checkpoint is tied gets the tie back
  if not R then
    for _, e in ipairs(index.params) do
      for _, a in ipairs(e.aliases or {}) do
        local ai, ti = P.by_path[a], P.by_path[e.path]
        if ai and ti and ai ~= ti and ai.path == a and own[a] == nil then
          plan.retie[#plan.retie + 1] = {alias = a, target = ti}
        end
      end
    end
  end
  local unexpected = {}
  for _, e in ipairs(index.params) do
    if not used[e.path] then unexpected[#unexpected + 1] = e.path end
  end
  if opts.strict ~= false then
    local problems = C.strict_problems(missing, unexpected, "checkpoint")
    if problems then fail(("%s: %s"):format(ipath, problems)) end
  end
  return plan
end

-- Can this checkpoint serve the optimizer, schedule, loaders and random state? Sets plan.rng.
local function check_extras(ipath, index, opts, loaders, plan)
  local W, rank = core.world_size(), core.rank()
  local opt = opts.optimizer
  if opt then
    if index.optimizer == nil then
      fail(("%s: the checkpoint holds no optimizer state (saved without optimizer =)"):format(ipath))
    end
    if index.optimizer.kind ~= opt.kind then
      fail(("%s: the checkpoint holds %s state, the optimizer is %s"):format(ipath, index.optimizer.kind, opt.kind))
    end
  end
  local sched = opts.schedule
  if sched then
    if index.schedule == nil then
      fail(("%s: the checkpoint holds no schedule (saved without schedule =)"):format(ipath))
    end
    if sched.kind ~= nil and index.schedule.kind ~= sched.kind then
      fail(("%s: the checkpoint holds a %s schedule, the schedule is %s")
        :format(ipath, tostring(index.schedule.kind), tostring(sched.kind)))
    end
    -- the schedule takes its state after the parameters are written: whatever would refuse
    -- it must refuse it now (fsdp.optim's schedules say so; a schedule without load_problem
    -- is loaded first after the agreement, checkpoint.lua)
    local why = type(sched.load_problem) == "function" and sched:load_problem(index.schedule)
    if why then fail(("%s: the schedule: %s"):format(ipath, why)) end
  end
  for name in pairs(loaders) do
    if index.loaders == nil or index.loaders[name] == nil then
      fail(("%s: no position saved for data loader '%s'"):format(ipath, name))
    end
  end
  if opts.rng ~= false and index.rng then
    if index.world_size == W then
      plan.rng = index.rng[rank + 1]
    else
      local a = core.json_encode(index.rng[1])
      for i = 2, #index.rng do
        if core.json_encode(index.rng[i]) ~= a then
          fail(("%s: saved at %d ranks with a different random state on each; a world size of %d "
            .. "cannot take them over (load at %d ranks, or pass rng = false)")
            :format(ipath, index.world_size, W, index.world_size))
        end
      end
      plan.rng = index.rng[1]
    end
    -- the index's check leaves the streams' names and offsets to set_rng_state, which runs
    -- last when applying: checked now, while a refusal still changes nothing
    local okr, why = pcall(core.check_rng_state, plan.rng)
    if not okr then
      why = util.message(why):gsub("^set_rng_state: ", "")
      fail(("%s: the random state: %s"):format(ipath, why))
    end
  end
end

--- Phase A of a sharded load (local, may fail): check the index against the model and the
--- options, read this rank's part of everything into new tensors. Returns the plan {items =
--- {{it =, data =, mask =, optim =}}, index =, extra =, retie =, rng =}.
function S.stage(dir, opts, loaders, P, parts, R)
  dir = C.strip_slashes(dir)
  local ipath = C.path_join(dir, INDEX)
  if core.io_size(ipath) == nil and core.io_size(dir) == nil then
    local _, why = core.io_size(ipath)
    fail(("%s: neither a safetensors file nor a sharded checkpoint folder (%s)"):format(dir, why))
  end
  local index = core.ckpt_index_read(ipath)
  local opt = opts.optimizer
  local plan = match_index(ipath, index, opts, P, R)
  check_extras(ipath, index, opts, loaders, plan)
  local files = file_set(dir, ipath, index)

  -- read `name` of the pieces into a new 1-D tensor of count elements (filed under `role` in
  -- the memory accounting: optimizer state is read straight into the buffers the optimizer
  -- then adopts); a piece that is not a whole stored tensor is read as a range and its tensor
  -- verified whole (checksums cover whole tensors); a whole one is checked by the read itself
  local function gather_parts(pieces, name, count, optional, role, like)
    if optional then
      local found = 0
      for _, pc in ipairs(pieces) do
        if files.get(pc.rank, name).entries[name] then found = found + 1 end
      end
      if found == 0 then return nil end
    end
    local out = core.zeros({count}, {role = role or "other", dtype = like and like.dtype or "f32",
      device = like and like.device})
    for _, pc in ipairs(pieces) do
      local F = files.get(pc.rank, name)
      local e = F.entries[name]
      if e == nil then
        fail(("%s: tensor '%s' is missing (the index says this file holds elements [%d, %d) of %s)")
          :format(F.path, name, pc.s.first, pc.s.first + pc.s.count, name:match("^[^:]*")))
      end
      if #e.shape ~= 1 or e.shape[1] ~= pc.s.count then
        fail(("%s: tensor '%s': shape %s, the index says (%d)"):format(F.path, name, shape_str(e.shape), pc.s.count))
      end
      F.r:read(name, pc.src_off, pc.n, out:narrow(1, pc.dst_off + 1, pc.n))
      if pc.n ~= pc.s.count and not F.verified[name] then
        F.r:verify(name)
        F.verified[name] = true
      end
    end
    return out
  end

  local states = index.optimizer and index.optimizer.states or {}
  -- optimizer state is read into buffers like the optimizer's own (f32 on the parameter's
  -- device when it has none yet): the buffers read become its state
  local current = {}
  if opt then
    for _, sl in ipairs(opt:export_slices()) do current[sl.param] = sl.tensors end
  end
  local function state_like(p, sname, part)
    local t = current[p] and current[p][sname]
    if t then return {dtype = t:dtype(), device = t.device} end
    return {dtype = "f32", device = part.device}
  end
  for _, x in ipairs(plan.items) do
    local part = parts[x.it.param]
    local a, n = part.first, part.count
    if n > 0 then
      local pieces = pieces_of(x.e, a, n)
      x.data = gather_parts(pieces, x.e.path, n, false, nil, part)
      for _, ce in ipairs(x.copies) do
        local copy = gather_parts(pieces_of(ce, a, n), ce.path, n, false, nil, part)
        C.check_tied_copy(ipath, x.it, x.e.path, x.data, ce.path, copy)
        copy:free()
      end
      if x.e.mask then x.mask = gather_parts(pieces, x.e.path .. MASK_SUFFIX, n) end
      if opt then
        -- state: present in every piece's file, or in none
        local present = 0
        for _, pc in ipairs(pieces) do
          files.get(pc.rank, x.e.path)
          if files.scalars_of[pc.rank][x.e.path] ~= nil then present = present + 1 end
        end
        if present ~= 0 and present ~= #pieces then
          fail(("%s: optimizer state of %s is saved for some of its slices only"):format(ipath, x.e.path))
        end
        if present > 0 then
          local st = {param = x.it.param, first = a, count = n, tensors = {},
            scalars = files.scalars_of[pieces[1].rank][x.e.path] or {}}
          for _, sname in ipairs(states) do
            st.tensors[sname] = gather_parts(pieces, x.e.path .. ":" .. sname, n, true, "optim",
              state_like(x.it.param, sname, part))
          end
          x.optim = st
        end
      end
    elseif x.e.mask then
      x.mask = core.zeros{0}
    end
  end
  -- extra's tensors: whole, from rank 0's file, in their stored dtype
  if index.extra ~= nil then
    local listed = {}
    for _, xt in ipairs(index.extra_tensors or {}) do listed[xt.name] = xt end
    local got = {}
    for _, n in ipairs(C.extra_names(index.extra)) do
      local xt = listed[n]
      if xt == nil then
        fail(("%s: extra names tensor '%s', which extra_tensors does not list"):format(ipath, n))
      end
      local F = files.get(0, n)
      local e = F.entries[n]
      if e == nil or e.dtype ~= xt.dtype or not C.same_shape(e.shape, xt.shape or {}) then
        fail(("%s: tensor '%s' is missing or is not the %s %s the index lists"):format(F.path, n,
          xt.dtype, shape_str(xt.shape or {})))
      end
      got[n] = F.r:read(n)
    end
    plan.extra = C.join_extra(index.extra, function(n) return got[n] end)
  end
  files.close()
  return plan
end

return S
