-- fsdp.nn — neural-network modules. See docs/nn.md.
--
-- The pieces live in lua/fsdp/nn/: module.lua (the Module protocol, registration, traversal,
-- error paths, path-based initialisation), layers.lua (Linear ... Block), gpt.lua (GPT),
-- lora.lua (low-rank adapters).
-- This file assembles the public table and nn.F.

local core = require "fsdp.core"
local base = require "fsdp.nn.module"
local L = require "fsdp.nn.layers"
local GPT = require "fsdp.nn.gpt"
local ckpt = require "fsdp.nn.checkpoint"
local util = require "fsdp.util"
local lora = require "fsdp.nn.lora"

local nn = {}

nn.Module = base.Module
nn.is_module = base.is_module
nn.is_param = base.is_param
nn.isinstance = base.isinstance
nn.class_of = base.class_of
nn.init_tree = base.init_tree
nn.init_record = base.init_record

-- nn.Parameter(t) marks t as a parameter (requires_grad, is_param) and returns it (the same
-- tensor object). t must be a leaf.
function nn.Parameter(t)
  if not base.is_tensor(t) then
    base.raise(("nn.Parameter: expected a tensor (got %s)"):format(type(t)))
  end
  return core.parameter(t)
end

-- nn.new_param(shape): a new parameter for a custom module, on the current parameter device
-- (fill it in the module's reset_parameters with self:init_param for path-based values).
nn.new_param = L.new_param

-- nn.set_param_device(device) -> previous: "meta" makes new_param create shape-only
-- parameters (what fsdp.meta uses), nil goes back to the cpu.
function nn.set_param_device(device)
  if device ~= nil and device ~= "meta" and device ~= "cpu" then
    base.raise(("nn.set_param_device: unknown device %s"):format(tostring(device)))
  end
  local prev = L.param_device
  L.param_device = device ~= "cpu" and device or nil
  return prev
end

for _, name in ipairs{"Linear", "Embedding", "LayerNorm", "ReLU", "GELU", "Dropout", "Sequential",
    "ModuleList", "CausalSelfAttention", "MLP", "Block"} do
  nn[name] = L[name]
end
nn.GPT = GPT

-- nn.checkpoint(m, {enabled = true}) -> m: activation checkpointing of m, marked in place (no
-- wrapper: paths and parameters stay as they are). m's forward runs without saving its
-- activations and backward runs it again before its gradients (lua/fsdp/nn/checkpoint.lua).
-- enabled = false removes the mark. nn.is_checkpointed(m) tells.
function nn.checkpoint(m, opts)
  if not base.is_module(m) then
    base.raise(("nn.checkpoint: expected a module (got %s)"):format(type(m)))
  end
  opts = util.check_opts("nn.checkpoint", opts, {"enabled"})
  if opts.enabled ~= nil and type(opts.enabled) ~= "boolean" then
    base.raise(("nn.checkpoint: enabled must be a boolean (got %s)"):format(type(opts.enabled)))
  end
  if base.isinstance(m, L.ModuleList) then
    base.raise("nn.checkpoint: a ModuleList has no forward to checkpoint; checkpoint its elements")
  end
  ckpt.mark(m, opts.enabled ~= false)
  return m
end

function nn.is_checkpointed(m) return base.is_module(m) and ckpt.is_marked(m) end
-- Low-rank adapters (nn/lora.lua): nn.lora.apply(model, opts), nn.lora.merge(model); the
-- adapter module nn.LoRA and the adapted Linear's class nn.LoRALinear.
nn.lora = {apply = lora.apply, merge = lora.merge}
nn.LoRA, nn.LoRALinear = lora.LoRA, lora.LoRALinear

-- nn.F: every fsdp.F op (looked up at call time, so ops the engine adds later appear here),
-- plus the losses with their documented signatures.
nn.F = setmetatable({}, {__index = function(_, k) return core.F[k] end})

-- cross_entropy(logits (..., C), targets (...), {ignore_index = -1}) -> mean over the
-- positions whose target is not ignore_index (0-dim tensor). Targets are class ids from 0.
function nn.F.cross_entropy(logits, targets, opts)
  return core.F.cross_entropy(logits, targets, opts)
end

-- mse(a, b) -> mean of (a - b)^2 over all elements (0-dim tensor).
function nn.F.mse(a, b)
  return core.F.mse(a, b)
end

return nn
