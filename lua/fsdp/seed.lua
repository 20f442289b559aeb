-- fsdp.seed — the seed in force and how many times fsdp.manual_seed has set it; init.lua
-- re-exports manual_seed, seed and seed_epoch as fsdp's. A library file that needs the count
-- (nn/module.lua) requires this file, never "fsdp".
--
-- The count (per Lua state, so per rank) lets nn restart its count of outermost module
-- constructions (docs/nn.md, "Initialisation"); fsdp.core.manual_seed alone does not add to it.

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
function S.seed_epoch() return epoch end

return S
