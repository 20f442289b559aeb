-- helpers.lua — small assertion and fixture helpers shared by the busted specs in tests/lua/
-- (ctest's LUA_PATH includes tests/lua/?.lua, so a spec does `local H = require "helpers"`).
-- Only helpers whose copies in the specs were the same live here; a spec-specific helper stays
-- in its spec. Assertions raise with error(msg, 2) so a failure points at the spec line that
-- called them.

-- busted gives specs luassert as `assert` through their environment only; a required module
-- must fetch it itself (the same module instance, so the same assertions and messages).
local assert = require "luassert"

local H = {}

-- All elements of a tensor (any shape, through totable) or a nested table, flattened in
-- row-major order into a plain list.
function H.flat(x)
  local out = {}
  local function go(v)
    if type(v) == "table" then for i = 1, #v do go(v[i]) end else out[#out + 1] = v end
  end
  go(type(x) == "userdata" and x:totable() or x)
  return out
end

-- All elements of tensor t through a flat view (so t must be viewable as 1-d: this errors on a
-- tensor a view cannot flatten, which the specs using it rely on).
function H.flat_view(t) return t:view{t:numel()}:totable() end

-- true when a and b (tensors or nested tables) hold exactly the same elements (H.flat).
function H.same_values(a, b)
  a, b = H.flat(a), H.flat(b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end

-- true when tensors a and b hold exactly the same elements (H.flat_view).
function H.same_values_view(a, b)
  local x, y = H.flat_view(a), H.flat_view(b)
  if #x ~= #y then return false end
  for i = 1, #x do if x[i] ~= y[i] then return false end end
  return true
end

-- pcall fn and check it fails with a message containing every given plain substring; returns
-- the message.
function H.assert_error_has(fn, ...)
  local ok, err = pcall(fn)
  assert.is_false(ok, "expected an error")
  err = tostring(err)
  for _, s in ipairs { ... } do
    if not err:find(s, 1, true) then
      error(("error message %q lacks %q"):format(err, s), 2)
    end
  end
  return err
end

-- Builds assert_close(a, b, tol, what): a and b (tensors or nested tables) have the same element
-- count and every |a[i] - b[i]| <= tol * (1 + |b[i]|), tol defaulting to default_tol; numbers in
-- the failure message are printed with fmt (e.g. "%.7g"). Specs differ in default tolerance
-- and precision, so each picks its own.
function H.make_assert_close(default_tol, fmt)
  local msg = "%s: element %d differs: " .. fmt .. " vs " .. fmt
  return function(a, b, tol, what)
    a, b = H.flat(a), H.flat(b)
    assert.are.equal(#b, #a, (what or "") .. ": element count")
    tol = tol or default_tol
    for i = 1, #a do
      if math.abs(a[i] - b[i]) > tol * (1 + math.abs(b[i])) then
        error(msg:format(what or "values", i, a[i], b[i]), 2)
      end
    end
  end
end

-- The common one: default tolerance 1e-5, 7 significant digits.
H.assert_close = H.make_assert_close(1e-5, "%.7g")

-- Temporary paths under the system temp dir. H.tmpname() is a fresh name with nothing there
-- (os.tmpname's empty file removed), for the file or folder a test makes; H.mktemp_dir() a fresh
-- empty folder. Each is noted, and H.remove_temps() removes all those noted so far, with what is
-- under them: a spec that makes any has `teardown(H.remove_temps)` at its top level, so that a
-- failing test leaves nothing behind either. H.rmtree(path) removes one at once.
local temps = {}

local function quote(p) return "'" .. p:gsub("'", "'\\''") .. "'" end

function H.tmpname()
  local p = os.tmpname()
  os.remove(p)
  temps[#temps + 1] = p
  return p
end

function H.mktemp_dir()
  local p = H.tmpname()
  assert(os.execute("mkdir -p " .. quote(p)) == 0)
  return p
end

function H.rmtree(p)
  os.execute("rm -rf " .. quote(p))
end

function H.remove_temps()
  if #temps == 0 then return end
  local q = {}
  for i, p in ipairs(temps) do q[i] = quote(p) end
  os.execute("rm -rf " .. table.concat(q, " "))
  temps = {}
end

-- Writes text to path (binary), failing loudly.
function H.write_file(path, text)
  local f = assert(io.open(path, "wb"))
  f:write(text)
  f:close()
end

-- An output handle (write/flush) that keeps what is written in .text.
function H.sink()
  local s = { text = "" }
  function s:write(...)
    for i = 1, select("#", ...) do self.text = self.text .. tostring((select(i, ...))) end
    return self
  end
  function s:flush() end
  return s
end

-- m wrapped with one unit per nn.Block: returns m and its root unit.
function H.wrap_blocks(m)
  local fsdp = require "fsdp"
  fsdp.wrap(m, {policy = fsdp.policy.modules{fsdp.nn.Block}})
  for _, u in ipairs(fsdp.units(m)) do
    if u.path == "(root)" then return m, u end
  end
end

return H
