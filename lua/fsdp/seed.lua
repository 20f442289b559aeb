-- fsdp.seed — the seed in force and how many times fsdp.manual_seed has set it. init.lua
-- re-exports these as fsdp.manual_seed, fsdp.seed and fsdp.seed_epoch; the library files that
-- need them (nn, data) require this file instead of "fsdp", so nothing below init.lua
-- requires it.
--
-- The epoch (a count of manual_seed calls, per Lua state, that is per rank) lets nn restart
-- its count of outermost module constructions (docs/nn.md, "Initialisation").

local core = require "fsdp.core"

local S = {}

local epoch = 0

--- Same seed => same values on every rank; starts a new epoch.
function S.manual_seed(n)
  core.manual_seed(n)
  epoch = epoch + 1
end

--- The seed in force.
function S.seed() return core.seed() end

--- How many times manual_seed has run.
function S.epoch() return epoch end

return S
