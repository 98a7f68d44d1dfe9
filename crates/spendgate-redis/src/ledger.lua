-- spendgate ledger for Redis: one script, one ledger operation per call.
--
-- This is a transcription of spendgate-core's `Ledger` (ledger.rs): every operation gives the
-- same answers and leaves the same state. See lib.rs for the calling protocol:
--   KEYS[1] = the deployment's base key "{prefix}" (every key below starts with it, so all
--             keys share one hash tag and one cluster slot)
--   ARGV[1] = operation, ARGV[2] = now in ms ("" = this server's TIME), ARGV[3] = epoch id the
--   caller knows, ARGV[4] = lowest ledger_seq the caller accepts, ARGV[5] = policy, ARGV[6..] =
--   the operation's arguments.
--
-- Rules kept throughout:
-- * Every number is an integer below 2^53 (exact in a Lua double). Numbers are turned into
--   strings only through S() (Lua's own tostring/.. would print 14 significant digits) or kept
--   as numbers in records (doubles packed by `struct`; or msgpack, which stores integral
--   doubles as integers: exact).
-- * Decisions are made before the first write of an operation; the only writes that precede a
--   refusal or an error are due expiries, which are complete changes of their own (exactly as
--   the core's `advance` applies them before the operation).
-- * Loops are bounded: expiries per call, sweep batches, ties in listings.

-- Per-call state: set by `main` at the start of every call (a function library's locals
-- outlive a call; nothing below may carry anything from one call to the next except caches
-- that are pure functions of their keys (parsed policies, counter encodings, window indexes),
-- library functions, and per-call tables, which are emptied in place: see clear).
local B
-- Library functions as upvalues (cheaper than a global and a field lookup at each use); bound
-- by `main` on its first call, as the library's load environment does not offer them.
local rcall, spack, sunpack, ssub, sfmt, tconcat, mfloor, mmin, mmax
local MAX = 9007199254740991
-- The core's constants (spendgate_core::ledger), passed in front of the policy.
local RETENTION, IDEM_RETENTION, RECORDS_MAX, EXPIRIES_PER_CALL, ID_MAX = 0, 0, 0, 0, 0

local K_META, K_TIMERS, K_RATES, K_SLOTS, K_TOP, K_CWIN, K_RZ, K_GLOBALS
-- Counter keys by encoding (a pure function of the base and the encoding: kept across calls,
-- at most 4096, emptied when the base changes). One table: the main chunk is at Lua's bound
-- of 200 locals.
local KC = { keys = {}, n = 0 }
local function set_base(b)
  if b == B then return end
  B = b
  KC.keys, KC.n = {}, 0
  K_META = b .. ':meta'
  K_TIMERS = b .. ':timers'
  K_RATES = b .. ':rates'
  K_SLOTS = b .. ':slots'
  K_TOP = b .. ':top'
  K_CWIN = b .. ':cwin'
  K_RZ = b .. ':rz'
  K_GLOBALS = b .. ':globals'
end

-- The hash tag is the first {...} of a key, which is the base's, whatever follows it.
-- Runs, reservations and idempotency entries are keyed by ids of spendgate's own making
-- (random, fixed length; an idempotency key is hashed by the server before it gets here): an
-- id from outside only ever reads a key that does not exist. A counter's encoding holds ids
-- from outside (a conversation, a session, an address prefix: up to ID_MAX bytes of the
-- caller's choosing), so its key is the SHA-1 of the encoding: every counter key has the same
-- length, whatever a client sends. (Two encodings with one digest would share a counter:
-- both scopes charged, never less; SHA-1 offers no such pair below 2^63 work.)
local function kRun(id) return B .. ':r:' .. id end
local function kRes(id) return B .. ':s:' .. id end
local function kIdem(k) return B .. ':i:' .. k end
-- A run's step ids, in order: a list of its own (RPUSH at each step), not part of the run
-- record, so that the record a step rewrites stays the same size however many steps the run
-- took (as the core's run_steps index beside the run).
local function kSteps(id) return B .. ':rs:' .. id end
local function kCounter(enc)
  local keys = KC.keys
  local k = keys[enc]
  if not k then
    k = B .. ':c:' .. redis.sha1hex(enc)
    if KC.n >= 4096 then
      keys = {}
      KC.keys, KC.n = keys, 0
    end
    keys[enc] = k
    KC.n = KC.n + 1
  end
  return k
end

-- Records (runs, reservations, counters) are string keys read and written through these:
-- a read is kept for the rest of the command (RC: value, or false for none), a write waits in
-- WB until kv_flush writes them all in one MSET at the end of the command (reads see it); a
-- delete is done at once. kv_prefetch reads several keys in one MGET.
local RC, WB, WBN = {}, {}, 0
-- Empties a per-call table in place: it keeps its size, so the next call neither allocates it
-- nor rehashes it as it fills; one that grew large is replaced (an empty large table is slow to
-- scan).
local function clear(t)
  local n = 0
  for k in next, t do
    t[k] = nil
    n = n + 1
  end
  if n > 32 then return {} end
  return t
end
-- kv_flush's MSET arguments (emptied after each use)
local MSET_ARGS = {}
local function kv_get(k)
  local v = WB[k]
  if v then return v end
  v = RC[k]
  if v == nil then
    v = rcall('GET', k)
    RC[k] = v
  end
  return v or nil
end
local function kv_prefetch(keys)
  local n = #keys
  if n == 0 then return end
  if n == 1 then
    kv_get(keys[1])
    return
  end
  local vs = rcall('MGET', unpack(keys))
  for i = 1, n do
    local k = keys[i]
    if RC[k] == nil then RC[k] = vs[i] end
  end
end
local function kv_set(k, v)
  if not WB[k] then WBN = WBN + 1 end
  WB[k] = v
end
local function kv_del(k)
  if WB[k] then
    WB[k] = nil
    WBN = WBN - 1
  end
  RC[k] = false
  rcall('DEL', k)
end
local function kv_flush()
  if WBN > 0 then
    local args, i = MSET_ARGS, 0
    for k, v in pairs(WB) do
      args[i + 1] = k
      args[i + 2] = v
      i = i + 2
      -- (unpack's bound)
      if i >= 1000 then
        rcall('MSET', unpack(args, 1, i))
        i = 0
      end
    end
    if i > 0 then rcall('MSET', unpack(args, 1, i)) end
    local n = #args
    for j = 1, n do args[j] = nil end
    if n > 64 then MSET_ARGS = {} end
    WB, WBN = clear(WB), 0
  end
  RC = clear(RC)
end

local function S(x) return sfmt('%d', x) end
-- (a number in an answer becomes an integer reply: exact, and cheaper than a string; redis.call
-- takes numbers too, but prints them with %.17g, which costs more than S)
local function N(s) return tonumber(s) end
local function B01(b) if b then return '1' end return '0' end
-- (answers may hold integers: an integer reply, cheaper than a string; see N)
local function I01(b) if b then return 1 end return 0 end

-- Records are strings packed with `struct` (numbers as doubles: exact below 2^53; strings
-- after their length), which costs a fraction of msgpack's tables and strings.
-- A run is one string key (RUN_FMT), read into an array indexed by these:
local R_STATE, R_DEADLINE, R_LEASE, R_ROUNDS, R_TOOLS, R_RETRIES, R_ENDED = 1, 2, 3, 4, 5, 6, 7
-- The run's lifetime counter: R_C is 1 once it exists, then limit used reserved overrun
-- adjusted at R_C + 1 .. R_C + 5.
local R_C = 8
-- The (saturating) sum of the run's step charges, how many steps are held (a step is charged
-- once, when it settles from held) and how many there are (their ids: the list at kSteps).
local R_CHARGED, R_NHELD, R_NSTEPS = 14, 15, 16
-- R_IMM: what never changes, packed once at admission (IMM_FMT: the bounds and the mode, then
-- the msgpack of the rest, parsed only by the calls that need it; see run_imm), indexed by
-- these:
local R_IMM = 17
local R_ID, R_SESSION, R_CONV, R_IPS, R_CREATED, R_SLOTS, R_HOLD, R_MODE = 1, 2, 3, 4, 5, 6, 7, 8
-- R_IPS: list of {prefix, factor}; R_SLOTS: list of slot names; R_HOLD: hold id or ''.
-- The run bounds: in ctx out trb rounds tools retries secs cost shrink minout.
local R_B_IN, R_B_CTX, R_B_OUT, R_B_TRB, R_B_ROUNDS, R_B_TOOLS, R_B_RETRIES, R_B_SECS, R_B_COST = 9, 10, 11, 12,
  13, 14, 15, 16, 17
local R_B_SHRINK, R_B_MINOUT = 18, 19
-- state; deadline lease rounds tools retries ended, the counter (6), charged nheld nsteps;
-- imm.
-- (struct.pack copies a string byte by byte: the long one, imm, follows the packed head with
-- its length in it, joined by concatenation)
local RUN_FMT = '<I1c0dddddddddddddddI4'
-- the 11 bounds (R_B_IN ..), mode; then the rest (msgpack of id session conv ips created
-- slots hold)
local IMM_FMT = '<dddddddddddI1c0'
-- Run records read in this call (false: none), and those changed since: run_get and run_put
-- go through the cache, and main writes every changed record once at the end of the call.
local RUNS, RDIRTY = {}, {}
local function run_get(id)
  local r = RUNS[id]
  if r == nil then
    local s = kv_get(kRun(id))
    if s then
      local st, dl, ls, ro, to, re, en, c, c1, c2, c3, c4, c5, ch, nh, ns, _, pos = sunpack(RUN_FMT, s)
      r = { st, dl, ls, ro, to, re, en, c, c1, c2, c3, c4, c5, ch, nh, ns, ssub(s, pos) }
    else
      r = false
    end
    RUNS[id] = r
  end
  return r or nil
end
local function run_pack(r)
  return spack(RUN_FMT, #r[1], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[10], r[11], r[12],
    r[13], r[14], r[15], r[16], #r[17]) .. r[17]
end
local function imm_pack(bounds, mode, rest)
  local packed = cmsgpack.pack(rest)
  return spack(IMM_FMT, bounds[1], bounds[2], bounds[3], bounds[4], bounds[5], bounds[6], bounds[7],
    bounds[8], bounds[9], bounds[10], bounds[11], #mode, mode) .. packed
end
-- The immutable part of a run record: the bounds and the mode, and with `full` the rest.
local function run_imm(r, full)
  -- (the constructor sizes the array part at once)
  local t = { false, false, false, false, false, false, false, false, false, false, false, false, false, false, false,
    false, false, false, false }
  t[R_B_IN], t[R_B_CTX], t[R_B_OUT], t[R_B_TRB], t[R_B_ROUNDS], t[R_B_TOOLS], t[R_B_RETRIES], t[R_B_SECS],
    t[R_B_COST], t[R_B_SHRINK], t[R_B_MINOUT], t[R_MODE], t.pos = sunpack(IMM_FMT, r[R_IMM])
  if full then
    local x = cmsgpack.unpack(ssub(r[R_IMM], t.pos))
    t[R_ID], t[R_SESSION], t[R_CONV], t[R_IPS], t[R_CREATED], t[R_SLOTS], t[R_HOLD] = x[1], x[2], x[3], x[4], x[5],
      x[6], x[7]
  end
  return t
end
local function run_put(id, r)
  RUNS[id] = r
  RDIRTY[id] = true
end
local function run_del(id)
  RUNS[id] = false
  RDIRTY[id] = nil
  kv_del(kRun(id))
end
local function run_flush()
  for id in pairs(RDIRTY) do
    kv_set(kRun(id), run_pack(RUNS[id]))
  end
  RDIRTY = clear(RDIRTY)
end

-- floor(a / b) for non-negative integers a, b with a < 2^53
local function idiv(a, b)
  local q = mfloor(a / b)
  if q * b > a then q = q - 1 elseif (q + 1) * b <= a then q = q + 1 end
  return q
end
local function ceil_div(a, b)
  local q = idiv(a, b)
  if q * b < a then q = q + 1 end
  return q
end

-- netstring lists ("3:abc0:2:xy"), for lists stored as one string
local function enc(list)
  local out = {}
  for i = 1, #list do
    local s = list[i]
    if type(s) == 'number' then s = S(s) end
    out[#out + 1] = S(#s) .. ':' .. s
  end
  return tconcat(out)
end
local function dec(s)
  local r = {}
  if not s then return r end
  local pos, n = 1, #s
  while pos <= n do
    local c = string.find(s, ':', pos, true)
    if not c then break end
    local len = N(ssub(s, pos, c - 1))
    r[#r + 1] = ssub(s, c + 1, c + len)
    pos = c + 1 + len
  end
  return r
end

---------------------------------------------------------------- calendar (window.rs)

-- (window_index and resets_at are the locals declared here)
local window_index, resets_at
do
  local function civil_from_days(z)
    z = z + 719468
    local era = mfloor(z / 146097)
    local doe = z - era * 146097
    local yoe = mfloor((doe - mfloor(doe / 1460) + mfloor(doe / 36524) - mfloor(doe / 146096)) / 365)
    local y = yoe + era * 400
    local doy = doe - (365 * yoe + mfloor(yoe / 4) - mfloor(yoe / 100))
    local mp = mfloor((5 * doy + 2) / 153)
    local d = doy - mfloor((153 * mp + 2) / 5) + 1
    local m
    if mp < 10 then m = mp + 3 else m = mp - 9 end
    if m <= 2 then y = y + 1 end
    return y, m, d
  end

  local function days_from_civil(y, m, d)
    if m <= 2 then y = y - 1 end
    local era = mfloor(y / 400)
    local yoe = y - era * 400
    local mm
    if m > 2 then mm = m - 3 else mm = m + 9 end
    local doy = mfloor((153 * mm + 2) / 5) + d - 1
    local doe = yoe * 365 + mfloor(yoe / 4) - mfloor(yoe / 100) + doy
    return era * 146097 + doe - 719468
  end

  function window_index(w, now)
    local secs = idiv(now, 1000)
    if w == 'hour' then return idiv(secs, 3600) end
    if w == 'day' then return idiv(secs, 86400) end
    if w == 'month' then
      local y, m = civil_from_days(idiv(secs, 86400))
      return y * 12 + m - 1
    end
    return 0
  end

  function resets_at(w, idx)
    if w == 'hour' then return (idx + 1) * 3600000 end
    if w == 'day' then return (idx + 1) * 86400000 end
    if w == 'month' then
      local nx = idx + 1
      return days_from_civil(mfloor(nx / 12), nx % 12 + 1, 1) * 86400000
    end
    return nil
  end
end

---------------------------------------------------------------- money (money.rs)

-- Splits a decimal string of up to 20 digits into hi * 10^6 + lo, both exact.
local mulsum
do
  local function split6(xs)
    if #xs > 6 then return N(ssub(xs, 1, -7)), N(ssub(xs, -6)) end
    return 0, N(xs)
  end

  -- For terms {count_string, price}: the sum of count * price as floor(sum / 10^6), the
  -- remainder, and whether the quotient exceeds MAX. Exact for counts below 2^64 and prices
  -- below 2^53 (the core computes the same in u128).
  function mulsum(terms)
    local I, F, over = 0, 0, false
    for _, t in ipairs(terms) do
      local xh, xl = split6(t[1])
      local p = t[2]
      local pa = idiv(p, 1000000)
      local pb = p - pa * 1000000
      local a = xh * p
      if a > MAX then over = true else I = I + a end
      I = I + xl * pa
      F = F + xl * pb
      if I > MAX then over = true end
    end
    local fq = idiv(F, 1000000)
    I = I + fq
    if I > MAX then over = true end
    return I, F - fq * 1000000, over
  end
end

-- ceil(sum / 10^6), saturating at MAX (ModelPrice::bound / ::charge)
local function price_ceil(terms)
  local I, R, over = mulsum(terms)
  if over then return MAX end
  if R > 0 then I = I + 1 end
  return mmin(I, MAX)
end

-- ToolPrice::cost: per_call + per_unit * units, saturating at MAX
local function tool_cost(pc, pu, units_s)
  if pu == 0 then return mmin(pc, MAX) end
  local u = N(units_s)
  if u > MAX then return MAX end
  local prod = pu * u
  if prod > MAX then return MAX end
  return mmin(prod + pc, MAX)
end

-- The largest out <= cap with prompt * ip + out * op <= room * 10^6, or nil when not even
-- out = 0 fits (ModelPrice::max_output_within(...).min(cap)).
local function fit_output(prompt_s, ip, op, room, cap)
  local function fits(o)
    local I, R, over = mulsum({ { prompt_s, ip }, { S(o), op } })
    if over then return false end
    return I < room or (I == room and R == 0)
  end
  if not fits(0) then return nil end
  if op == 0 or fits(cap) then return cap end
  local lo, hi = 0, cap -- fits(lo), not fits(hi)
  while hi - lo > 1 do
    local mid = lo + mfloor((hi - lo) / 2)
    if fits(mid) then lo = mid else hi = mid end
  end
  return lo
end

---------------------------------------------------------------- policy

local P = nil
local policy
do
  local function parse_policy(s)
    local t = {}
    for w in string.gmatch(s, '%S+') do t[#t + 1] = w end
    local i = 0
    local function nx() i = i + 1; return t[i] end
    local function nn() return N(nx()) end
    local p = { kinds = {} }
    RETENTION, IDEM_RETENTION, RECORDS_MAX, EXPIRIES_PER_CALL, ID_MAX = nn(), nn(), nn(), nn(), nn()
    for _, kind in ipairs({ 'global', 'ip', 'session', 'conversation' }) do
      local kp = { budgets = {} }
      local nb = nn()
      for _ = 1, nb do
        local w = nx()
        kp.budgets[#kp.budgets + 1] = { w, nn() }
      end
      if nn() == 1 then kp.rate = { nn(), nn(), nn() } end
      if nn() == 1 then kp.conc = nn() end
      kp.dry = nn() == 1
      p.kinds[kind] = kp
    end
    local r = {}
    for _, f in ipairs({ 'in', 'ctx', 'out', 'trb', 'rounds', 'tools', 'retries', 'secs', 'cost', 'shrink', 'minout' }) do
      r[f] = nn()
    end
    p.run = r
    p.mode = nx()
    p.ttl = nn()
    if nn() == 1 then p.sc_ip = { nn(), nn(), nn() } end
    if nn() == 1 then p.sc_global = { nn(), nn(), nn() } end
    p.consts = { RETENTION, IDEM_RETENTION, RECORDS_MAX, EXPIRIES_PER_CALL, ID_MAX }
    -- whether a step has budgets of scopes other than global
    p.scoped = #p.kinds.ip.budgets + #p.kinds.session.budgets + #p.kinds.conversation.budgets > 0
    return p
  end

  -- Parsed policies by policy string (a pure function of the string; replicas of one deployment
  -- send the same one). Bounded: cleared when it holds too many.
  local POLICIES, POLICIES_N = {}, 0
  function policy(s)
    local p = POLICIES[s]
    if not p then
      p = parse_policy(s)
      if POLICIES_N >= 16 then
        POLICIES, POLICIES_N = {}, 0
      end
      POLICIES[s] = p
      POLICIES_N = POLICIES_N + 1
    end
    RETENTION, IDEM_RETENTION, RECORDS_MAX, EXPIRIES_PER_CALL, ID_MAX = unpack(p.consts)
    return p
  end
end

---------------------------------------------------------------- rates (rate.rs)

local function rate_scaled(r, f)
  return { r[1] * f, r[2], r[3] * f }
end
local function rate_interval(r)
  return mmax(ceil_div(r[2] * 1000, mmax(r[1], 1)), 1)
end
local function rate_tolerance(r)
  return rate_interval(r) * mmax(r[3], 1)
end
-- true, new_tat | false, wait_us
local function rate_check(r, tat, now_us)
  local iv = rate_interval(r)
  local tol = iv * mmax(r[3], 1)
  local new = mmax(tat, now_us) + iv
  local ahead = new - now_us
  if ahead <= tol then return true, new end
  return false, ahead - tol
end
-- Rate::left: remaining, reset_s of a key whose TAT an admission has just written
local function rate_left(r, tat, now_us)
  local iv = rate_interval(r)
  local tol = iv * mmax(r[3], 1)
  local slack = mmax(tol - mmax(tat - now_us, 0), 0)
  local rem = idiv(slack, iv)
  return rem, ceil_div(iv - (slack - rem * iv), 1000000)
end
local function rate_get(key)
  local v = rcall('ZSCORE', K_RATES, key)
  if v then return N(v) end
  return 0
end
local function wait_secs(wait_us)
  return mmax(ceil_div(wait_us, 1000000), 1)
end

---------------------------------------------------------------- meta

-- The meta hash holds the epoch ('epoch', 'epoch_kind', 'epoch_at') and everything else in
-- one packed field 'm' (M_FMT): seq, then MV (the clock, the counts, TN, and the sums of
-- amounts as two limbs each, hi * 2^32 + lo, exact far beyond 2^53), then the cutoff reason
-- ('' = none). It is read once at the start of a call (with the epoch: one HMGET of two
-- fields) and written once at its end (meta_flush), when anything changed.
local M_FMT = '<dddddddddddddddI4c0'
local SEQ, SEQ0 = 0, 0
-- MV: clock nrec active held committed released unknown expired overruns tnext,
-- held_sum (hi lo) charged_sum (hi lo); a limb (lo) is below 4294967296 (2^32)
local MV = { 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0 }
local CUT = false
local MDIRTY = false
-- mincr's field names: an index of MV (11 and 13: the sums)
local M_IDX = { clock = 1, nrec = 2, active = 3, ['st:held'] = 4, ['st:committed'] = 5, ['st:released'] = 6,
  ['st:unknown'] = 7, ['st:expired'] = 8, overruns = 9, tnext = 10, held_sum = 11, charged_sum = 13 }
-- a reservation state's summary field
local ST_KEY = { held = 'st:held', committed = 'st:committed', released = 'st:released', unknown = 'st:unknown',
  expired = 'st:expired' }
-- TN: no timer is due before it (a lower bound of the timers' first score, kept in meta as
-- 'tnext'; 0 when unknown), so that a call with now < TN need not look at the timers.
local TN, TN0 = 0, 0
-- Loads meta from its packed field (nil: a new ledger).
local function meta_unpack(m)
  if m then
    local cl
    SEQ, MV[1], MV[2], MV[3], MV[4], MV[5], MV[6], MV[7], MV[8], MV[9], MV[10], MV[11], MV[12], MV[13], MV[14], cl =
      sunpack(M_FMT, m)
    if cl == '' then CUT = false else CUT = cl end
  else
    SEQ = 0
    for i = 1, 14 do MV[i] = 0 end
    CUT = false
  end
  SEQ0 = SEQ
  TN = MV[10]
  TN0 = TN
  MDIRTY = false
end
-- Every timer is added here, which keeps TN a lower bound.
local function timer_add(at, member)
  rcall('ZADD', K_TIMERS, S(at), member)
  if at < TN then TN = at end
end
local function bump()
  SEQ = SEQ + 1
end
local function mincr(f, n)
  if n ~= 0 then
    local i = M_IDX[f]
    if i < 11 then
      MV[i] = MV[i] + n
    else
      -- exact: n = dh * 2^32 + dl with 0 <= dl < 2^32
      local dh = mfloor(n / 4294967296)
      local l = MV[i + 1] + (n - dh * 4294967296)
      local h = MV[i] + dh
      if l >= 4294967296 then
        l = l - 4294967296
        h = h + 1
      end
      MV[i], MV[i + 1] = h, l
    end
    MDIRTY = true
  end
end
-- A sum as an answer: exact when within +-2^53, else MAX (the caller caps at MAX too).
local function msum(i)
  local h = MV[i]
  if h >= 2097152 then return S(MAX) end
  if h < -2097152 then return S(-MAX) end
  return S(mmin(h * 4294967296 + MV[i + 1], MAX))
end
-- Writes meta (with `clock` the new clock) when anything changed.
local function meta_flush(clock)
  if clock then
    MV[1] = clock
    MDIRTY = true
  end
  if TN ~= TN0 then
    MV[10] = TN
    MDIRTY = true
  end
  if MDIRTY or SEQ ~= SEQ0 then
    local cl = CUT or ''
    rcall('HSET', K_META, 'm', spack(M_FMT, SEQ, MV[1], MV[2], MV[3], MV[4], MV[5], MV[6], MV[7], MV[8],
      MV[9], MV[10], MV[11], MV[12], MV[13], MV[14], #cl, cl))
  end
  -- (the next command of a batch starts from what is written)
  SEQ0, TN0, MDIRTY = SEQ, TN, false
end
local function records_held()
  return MV[2]
end
local function cutoff()
  return CUT
end

---------------------------------------------------------------- scopes

local function disp(kind, id)
  if kind == 'global' then return 'global' end
  return kind .. ':' .. id
end

local function run_scopes(session, ips, conv)
  local v = { { 'global', '', 1 } }
  for _, ip in ipairs(ips) do v[#v + 1] = { 'ip', ip[1], mmax(ip[2], 1) } end
  v[#v + 1] = { 'session', session, 1 }
  v[#v + 1] = { 'conversation', conv, 1 }
  return v
end

local function check_id(what, id)
  if #id == 0 or #id > ID_MAX then
    return what .. ' must be 1 to ' .. S(ID_MAX) .. ' bytes'
  end
  return nil
end

---------------------------------------------------------------- counters

-- Parsed encodings (a pure function of the string: kept across calls, bounded).
local CPARTS, CPARTS_N = {}, 0
local function cparts(e)
  local p = CPARTS[e]
  if not p then
    local w, idx, kind = string.match(e, '^([^|]*)|([^|]*)|([^|]*)|')
    p = { w, N(idx), kind }
    if CPARTS_N >= 4096 then
      CPARTS, CPARTS_N = {}, 0
    end
    CPARTS[e] = p
    CPARTS_N = CPARTS_N + 1
  end
  return p[1], p[2], p[3]
end
-- Counters loaded in this call, by encoding (main clears it; csave and cdel keep it current).
-- `score` is the counter's score in the top indexes as stored.
local CC = {}
-- A run's lifetime counter is part of its run record (R_C); every other counter is a string
-- key of its own: limit, used, reserved, overrun, adjusted (COUNTER_FMT).
local COUNTER_FMT = '<ddddd'
local RUN_C = 'lifetime|0|run|'
local function run_of(e)
  -- (cparts is cached: no string is made for the other counters)
  local w, idx, kind = cparts(e)
  if kind == 'run' and idx == 0 and w == 'lifetime' then return ssub(e, #RUN_C + 1) end
  return nil
end
-- A counter as stored, as five numbers (nil: there is none).
local function cread(e)
  local rid = run_of(e)
  if rid then
    local r = run_get(rid)
    if r and r[R_C] == 1 then return { r[R_C + 1], r[R_C + 2], r[R_C + 3], r[R_C + 4], r[R_C + 5] } end
    return nil
  end
  local s = kv_get(kCounter(e))
  if not s then return nil end
  local l, u, r, o, a = sunpack(COUNTER_FMT, s)
  return { l, u, r, o, a }
end
local function cload(e)
  local c = CC[e]
  if c then return c end
  local f = cread(e)
  if not f then
    c = { enc = e, limit = 0, used = 0, reserved = 0, overrun = 0, adjusted = 0, new = true }
  else
    c = { enc = e, limit = f[1], used = f[2], reserved = f[3], overrun = f[4], adjusted = f[5] }
    c.score = mmin(c.used + c.reserved, MAX)
  end
  CC[e] = c
  return c
end
local function csave(c)
  local rid = run_of(c.enc)
  if rid then
    local r = run_get(rid)
    if not r then error('spendgate: the counter of a run that does not exist') end
    r[R_C], r[R_C + 1], r[R_C + 2], r[R_C + 3], r[R_C + 4], r[R_C + 5] = 1, c.limit, c.used, c.reserved, c.overrun,
      c.adjusted
    run_put(rid, r)
  else
    kv_set(kCounter(c.enc), spack(COUNTER_FMT, c.limit, c.used, c.reserved, c.overrun, c.adjusted))
  end
  local w, idx, kind = cparts(c.enc)
  if kind == 'global' then
    -- Global counters are few (one per budget window): not ranked, listed from a set.
    if c.new then
      rcall('SADD', K_GLOBALS, c.enc)
      c.new = false
    end
    return
  end
  local score = mmin(c.used + c.reserved, MAX)
  if score ~= c.score then
    rcall('ZADD', K_TOP .. ':' .. kind, S(score), c.enc)
    c.score = score
  end
  if c.new then
    local r = resets_at(w, idx)
    if r then rcall('ZADD', K_CWIN, S(r), c.enc) end
    c.new = false
  end
end
local function cdel(e)
  local _, _, kind = cparts(e)
  CC[e] = nil
  -- (a run's counter goes with its run record)
  if not run_of(e) then kv_del(kCounter(e)) end
  if kind == 'global' then
    rcall('SREM', K_GLOBALS, e)
    return
  end
  rcall('ZREM', K_TOP .. ':' .. kind, e)
  rcall('ZREM', K_CWIN, e)
end
-- What counter c has left under `limit` (the limit the request's policy gives it now).
local function remaining(c, limit)
  if c.overrun == 1 then return 0 end
  return mmax(mmax(limit - c.used, 0) - c.reserved, 0)
end

-- The budget counters (and limits) of these scopes at `now` (Ledger::budget_counters).
-- Appends the budget counters of scope (kind, id, factor) to v.
-- window -> { now, index, index as a string } of the last `now` asked (a pure function)
local WIDX = {}
local function scope_counters(v, kind, id, factor, now)
  local kp = P.kinds[kind]
  if kp then
    local bs = kp.budgets
    for i = 1, #bs do
      local b = bs[i]
      local w, amt = b[1], b[2]
      if factor ~= 1 then amt = mmin(amt * factor, MAX) end
      local wi = WIDX[w]
      if not wi or wi[1] ~= now then
        local idx = window_index(w, now)
        wi = { now, idx, S(idx) }
        WIDX[w] = wi
      end
      v[#v + 1] = { enc = w .. '|' .. wi[3] .. '|' .. kind .. '|' .. id, limit = amt, kind = kind, window = w,
        index = wi[2] }
    end
  end
end
local function budget_counters(scopes, now)
  local v = {}
  for _, s in ipairs(scopes) do scope_counters(v, s[1], s[2], s[3], now) end
  return v
end
-- budget_counters(run_scopes(session, ips, conv), now) without building the scopes.
local function run_budget_counters(session, ips, conv, now)
  local v = {}
  scope_counters(v, 'global', '', 1, now)
  for _, ip in ipairs(ips) do scope_counters(v, 'ip', ip[1], mmax(ip[2], 1), now) end
  scope_counters(v, 'session', session, 1, now)
  scope_counters(v, 'conversation', conv, 1, now)
  return v
end

-- (`held`: used spend alone would admit, the holds of calls in flight refuse: `budget_held`,
-- whose Retry-After the reader derives, as a spent budget's, from the window and `now`)
local function budget_refusal(k, c, now, held)
  if held then
    return { 'refused', 'budget_held', k.kind, '', 'held', k.window, S(k.index), S(c.used), S(c.reserved),
      S(k.limit), S(now) }
  end
  return { 'refused', 'budget_exhausted', k.kind, '', 'budget', k.window, S(k.index), S(c.used), S(c.reserved),
    S(k.limit), S(now) }
end

-- Whether a scope kind's limits are in dry-run (never 'run').
local function is_dry(kind)
  local kp = P.kinds[kind]
  return kp ~= nil and kp.dry
end

-- The refusal of the counters `amount` does not fit (admission::decide): a spent one before
-- any held one (spent: used spend alone leaves no room, or overrun); among spent ones the one
-- that frees last (the latest window reset, a lifetime budget a day away
-- (LIFETIME_RETRY_AFTER_S), the first of equals); else the first held one. Enforced counters
-- refuse (the first answer), else nil and the refusal counters in dry-run would give (nil when
-- none).
local function check_budgets(counters, amount, now)
  -- [1] enforced, [2] dry-run: { spent refusal, its reset, held refusal }
  local pick = { { nil, 0, nil }, { nil, 0, nil } }
  for _, k in ipairs(counters) do
    -- (a check writes nothing, not even into the cached counter: a refused command must
    -- leave the limit a later command of the same batch sees as it was)
    local c = cload(k.enc)
    if not (c.overrun == 0 and c.used + c.reserved + amount <= k.limit) then
      local p = pick[1]
      if is_dry(k.kind) then p = pick[2] end
      if c.overrun == 0 and c.used + amount <= k.limit then
        if not p[3] then p[3] = budget_refusal(k, c, now, true) end
      else
        local at = resets_at(k.window, k.index) or (now + 86400000)
        if not p[1] or at > p[2] then p[1], p[2] = budget_refusal(k, c, now, false), at end
      end
    end
  end
  local refusal = pick[1][1] or pick[1][3]
  if refusal then return refusal end
  return nil, pick[2][1] or pick[2][3]
end

-- (past its limit only in dry-run: the counter is then overrun)
local function hold(counters, amount)
  for _, k in ipairs(counters) do
    local c = cload(k.enc)
    c.limit = k.limit
    c.reserved = mmin(c.reserved + amount, MAX)
    if c.used + c.reserved > c.limit and is_dry(k.kind) then c.overrun = 1 end
    csave(c)
  end
end

-- Appends to an admitted outcome '0', or '1' and the fields of the dry-run refusal.
local function add_dry(outcome, dry)
  if not dry then
    outcome[#outcome + 1] = '0'
    return
  end
  outcome[#outcome + 1] = '1'
  for i = 2, #dry do outcome[#outcome + 1] = dry[i] end
end

---------------------------------------------------------------- reservations

-- A reservation is one string key (RES_FMT), read into an array indexed by these (in the
-- order of a listing's row); amount, charged, created, resolved ('' until it settles) and
-- overrun are numbers, counters a list of counter encodings, the rest strings.
local S_ID, S_RUN, S_KIND, S_NAME, S_P1, S_P2, S_P3, S_RETRY, S_UNITS, S_AMOUNT, S_COUNTERS = 1, 2, 3, 4, 5, 6, 7,
  8, 9, 10, 11
local S_STATE, S_CHARGED, S_CREATED, S_RESOLVED, S_MAXOUT, S_OVERRUN, S_BIG = 12, 13, 14, 15, 16, 17, 18
-- Stored as RES_HEAD (what a settlement changes, and amount; resolved -1 while there is
-- none), then RES_TAIL (packed once, when the reservation is made) and each counter encoding.
-- The record read keeps its tail (at S_TAIL), which a settlement writes back as it was.
-- (big: 1 when committed with a tool result above the run's max_tool_result_bytes)
local RES_HEAD = '<I1c0dddddI1' -- state amount charged created resolved overrun big
local RES_TAIL = '<I2c0I2c0I1c0I4c0I2c0I2c0I2c0I1c0I2c0I2c0I1' -- id run kind name p1 p2 p3 retry units maxout n
local S_TAIL = 19
local function res_get(id)
  local s = kv_get(kRes(id))
  if not s then return nil end
  local state, amount, charged, created, resolved, overrun, big, tpos = sunpack(RES_HEAD, s)
  local i, run, kind, name, p1, p2, p3, retry, units, maxout, n, pos = sunpack(RES_TAIL, s, tpos)
  local cs = {}
  for j = 1, n do cs[j], pos = sunpack('<I2c0', s, pos) end
  if resolved < 0 then resolved = '' end
  return { i, run, kind, name, p1, p2, p3, retry, units, amount, cs, state, charged, created, resolved, maxout, overrun,
    big, ssub(s, tpos) }
end
local function res_put(id, r)
  local resolved = r[S_RESOLVED]
  if resolved == '' then resolved = -1 end
  local tail = r[S_TAIL]
  if not tail then
    local cs = r[S_COUNTERS]
    local out = { spack(RES_TAIL, #r[1], r[1], #r[2], r[2], #r[3], r[3], #r[4], r[4], #r[5], r[5], #r[6], r[6],
      #r[7], r[7], #r[8], r[8], #r[9], r[9], #r[16], r[16], #cs) }
    for j = 1, #cs do out[j + 1] = spack('<I2c0', #cs[j], cs[j]) end
    tail = tconcat(out)
    r[S_TAIL] = tail
  end
  kv_set(kRes(id), spack(RES_HEAD, #r[S_STATE], r[S_STATE], r[S_AMOUNT], r[S_CHARGED], r[S_CREATED],
    resolved, r[S_OVERRUN], r[S_BIG] or 0) .. tail)
end

local function res_remove(id)
  local r = res_get(id)
  if not r then return end
  local state = r[S_STATE]
  rcall('ZREM', K_RZ .. ':' .. state, id)
  mincr(ST_KEY[state], -1)
  mincr('nrec', -1)
  if r[S_KIND] ~= 'hold' then
    if state == 'held' then mincr('held_sum', -r[S_AMOUNT]) end
    mincr('charged_sum', -r[S_CHARGED])
    mincr('overruns', -r[S_OVERRUN])
  end
  kv_del(kRes(id))
end

-- r: the new reservation (held). `fresh`: the caller already checked that no reservation has
-- this id.
local function res_create(id, r, fresh)
  local kind, amount, created = r[S_KIND], r[S_AMOUNT], r[S_CREATED]
  if not fresh and kv_get(kRes(id)) then res_remove(id) end
  res_put(id, r)
  rcall('ZADD', K_RZ .. ':held', S(created), id)
  mincr('st:held', 1)
  mincr('nrec', 1)
  if kind ~= 'hold' then mincr('held_sum', amount) end
end

-- Counter and summary changes of several settlements, applied once per counter: the result
-- is the same as applying them one by one (reserved saturates at 0, used at MAX, and
-- overrun is set once used passes the limit, which only grows).
local function acc_new() return { c = {}, ck = {}, m = {}, mk = {} } end
local function acc_meta(acc, f, n)
  if acc.m[f] == nil then
    acc.m[f] = 0
    acc.mk[#acc.mk + 1] = f
  end
  acc.m[f] = acc.m[f] + n
end
local function acc_flush(acc)
  for _, e in ipairs(acc.ck) do
    local d = acc.c[e]
    local c = cload(e)
    c.reserved = mmax(c.reserved - d[1], 0)
    c.used = mmin(c.used + d[2], MAX)
    if c.used > c.limit then c.overrun = 1 end
    csave(c)
  end
  for _, f in ipairs(acc.mk) do mincr(f, acc.m[f]) end
end

-- A summary change: into the accumulator when there is one, else straight to meta.
local function macc(acc, f, n)
  if acc then acc_meta(acc, f, n) else mincr(f, n) end
end

-- Ledger::settle: a held reservation reaches a terminal state, charging `charged`. With an
-- accumulator the counter and summary changes wait for acc_flush (without, they are applied
-- at once: the same result).
-- `pre`: the reservation when the caller already read it. A step's charge is added to its run.
local function settle(id, state, charged, now, acc, pre)
  local f = pre or res_get(id)
  if not f then return end
  local a = acc
  local old, kind, amount = f[S_STATE], f[S_KIND], f[S_AMOUNT]
  local old_charged, old_overrun = f[S_CHARGED], f[S_OVERRUN]
  local overrun = 0
  if charged > amount then overrun = 1 end
  f[S_STATE], f[S_CHARGED], f[S_RESOLVED], f[S_OVERRUN] = state, charged, now, overrun
  res_put(id, f)
  rcall('ZREM', K_RZ .. ':' .. old, id)
  rcall('ZADD', K_RZ .. ':' .. state, S(f[S_CREATED]), id)
  macc(a, ST_KEY[old], -1)
  macc(a, ST_KEY[state], 1)
  if kind ~= 'hold' then
    if old == 'held' then macc(a, 'held_sum', -amount) end
    macc(a, 'charged_sum', charged - old_charged)
    macc(a, 'overruns', overrun - old_overrun)
    local run = run_get(f[S_RUN])
    if run then
      run[R_CHARGED] = mmin(run[R_CHARGED] + charged, MAX)
      if old == 'held' then run[R_NHELD] = run[R_NHELD] - 1 end
      run_put(f[S_RUN], run)
    end
  end
  for _, e in ipairs(f[S_COUNTERS]) do
    if a then
      local d = a.c[e]
      if not d then
        d = { 0, 0 }
        a.c[e] = d
        a.ck[#a.ck + 1] = e
      end
      d[1] = d[1] + amount
      d[2] = mmin(d[2] + charged, MAX)
    else
      local c = cload(e)
      c.reserved = mmax(c.reserved - amount, 0)
      c.used = mmin(c.used + charged, MAX)
      if c.used > c.limit then c.overrun = 1 end
      csave(c)
    end
  end
end

-- Ledger::top_up: a late overrun. A terminal reservation's charge grows to `charged`, its
-- counters' used spend by the difference; its state and resolution time stay. Then a step's
-- run hold follows (whole_run): held, it grows to what the run was charged
-- (Ledger::run_hold_follows; after an overrun at commit, `charged` is nil and only this runs);
-- settled, it is topped up to it.
local function top_up(id, charged, f)
  local run_id = f[S_RUN]
  if charged then
    local delta = charged - f[S_CHARGED]
    local old_overrun = f[S_OVERRUN]
    local overrun = 0
    if charged > f[S_AMOUNT] then overrun = 1 end
    f[S_CHARGED], f[S_OVERRUN] = charged, overrun
    res_put(id, f)
    for _, e in ipairs(f[S_COUNTERS]) do
      local c = cload(e)
      c.used = mmin(c.used + delta, MAX)
      if c.used > c.limit then c.overrun = 1 end
      csave(c)
    end
    if f[S_KIND] == 'hold' then return end
    mincr('charged_sum', delta)
    mincr('overruns', overrun - old_overrun)
    local run = run_get(run_id)
    if run then
      run[R_CHARGED] = mmin(run[R_CHARGED] + delta, MAX)
      run_put(run_id, run)
    end
  end
  local run = run_get(run_id)
  local hid = run and run_imm(run, true)[R_HOLD] or ''
  if hid == '' then return end
  local h = res_get(hid)
  if not h then return end
  local used = cload(RUN_C .. run_id).used
  if h[S_STATE] == 'held' then
    if used > h[S_AMOUNT] then
      local delta = used - h[S_AMOUNT]
      h[S_AMOUNT] = used
      res_put(hid, h)
      for _, e in ipairs(h[S_COUNTERS]) do
        local c = cload(e)
        c.reserved = mmin(c.reserved + delta, MAX)
        if mmin(c.used + c.reserved, MAX) > c.limit then c.overrun = 1 end
        csave(c)
      end
    end
  elseif used > h[S_CHARGED] then
    top_up(hid, used, h)
  end
end

---------------------------------------------------------------- runs

local function run_counter(run_id, cost)
  return { enc = 'lifetime|0|run|' .. run_id, limit = cost, kind = 'run', window = 'lifetime', index = 0 }
end

-- Ledger::renew: extends an active run's lease by one TTL, never past its deadline. The
-- lease only grows, and its timer is not moved: a lease timer is due at or before the lease
-- (expire_due puts it at the lease when it finds it early), so a renewal writes no timer.
local function renew(id, now, ttl)
  local r = run_get(id)
  if not r or r[R_STATE] ~= 'active' then return nil end
  local deadline, lease = r[R_DEADLINE], r[R_LEASE]
  local new = mmax(mmin(now + ttl, deadline), mmin(lease, deadline))
  if new ~= lease then
    r[R_LEASE] = new
    run_put(id, r)
  end
  return new
end

-- Ledger::end_run: held steps charged in full, whole-run hold reconciled, slots freed.
local function end_run(id, now, endstate)
  local run = run_get(id)
  local step_end = 'unknown'
  if endstate == 'expired' then step_end = 'expired' end
  local acc = acc_new()
  if run[R_NHELD] > 0 then
    for _, s in ipairs(rcall('LRANGE', kSteps(id), '0', '-1')) do
      local r = res_get(s)
      if r and r[S_STATE] == 'held' then settle(s, step_end, r[S_AMOUNT], now, acc, r) end
    end
  end
  acc_flush(acc)
  local imm = run_imm(run, true)
  local hid = imm[R_HOLD]
  if hid ~= '' then
    local used = cload(RUN_C .. id).used
    local r = res_get(hid)
    local amount = 0
    if r then amount = r[S_AMOUNT] end
    if endstate == 'expired' then
      settle(hid, 'expired', mmax(amount, used), now, nil, r)
    else
      settle(hid, 'committed', used, now, nil, r)
    end
  end
  for _, s in ipairs(imm[R_SLOTS]) do
    local n = rcall('HGET', K_SLOTS, s)
    if n then
      n = N(n) - 1
      if n <= 0 then rcall('HDEL', K_SLOTS, s) else rcall('HSET', K_SLOTS, s, S(n)) end
    end
  end
  rcall('ZREM', K_TIMERS, '1|' .. id)
  timer_add(now + RETENTION, '2|' .. id)
  run[R_STATE] = endstate
  run[R_ENDED] = now
  run_put(id, run)
  mincr('active', -1)
end

local function purge_run(id)
  local run = run_get(id)
  if not run then return end
  local hid = run_imm(run, true)[R_HOLD]
  if run[R_NSTEPS] > 0 then
    local ks = kSteps(id)
    for _, s in ipairs(rcall('LRANGE', ks, '0', '-1')) do res_remove(s) end
    rcall('DEL', ks)
  end
  if hid ~= '' then res_remove(hid) end
  cdel(RUN_C .. id)
  run_del(id)
  mincr('nrec', -1)
end

---------------------------------------------------------------- timers

-- Ledger::expire_due: timers are "1|run" (lease), "2|run" (purge), "3|key" (idempotency),
-- ordered like the core's (time, Timer) set.
local function expire_due(now, max)
  if now < TN then return 0 end
  local done, pops = 0, 0
  -- What TN becomes: the first score left when none is due, 0 (unknown) when stopped by a bound.
  local next_tn = 0
  while done < max and pops < max * 4 do
    local t = rcall('ZRANGE', K_TIMERS, '0', '0', 'WITHSCORES')
    if #t == 0 then
      next_tn = MAX
      break
    end
    local at = N(t[2])
    if at > now then
      next_tn = at
      break
    end
    pops = pops + 1
    local typ, id = ssub(t[1], 1, 1), ssub(t[1], 3)
    local run = typ == '1' and run_get(id)
    if run and run[R_STATE] == 'active' and run[R_LEASE] ~= at then
      -- An early lease timer (renewals do not move it): put it at the lease, where it takes
      -- its place in the order of timers (as the core's), due in this call or not.
      rcall('ZADD', K_TIMERS, S(run[R_LEASE]), t[1])
    elseif typ == '1' then
      rcall('ZREM', K_TIMERS, t[1])
      if run and run[R_STATE] == 'active' then
        end_run(id, now, 'expired')
        bump()
        done = done + 1
      end
    elseif typ == '2' then
      -- (dropping records is a change: ledger_seq moves, as in the core)
      rcall('ZREM', K_TIMERS, t[1])
      purge_run(id)
      bump()
      done = done + 1
    else
      rcall('ZREM', K_TIMERS, t[1])
      local ex = rcall('HGET', kIdem(id), 'expires')
      if ex and N(ex) <= now then
        rcall('DEL', kIdem(id))
        mincr('nrec', -1)
        bump()
        done = done + 1
      end
    end
  end
  TN = next_tn
  return done
end

---------------------------------------------------------------- idempotency

-- nil | {kind, outcome list} | error string
local function recall(key, fp)
  local bad = check_id('idempotency key', key)
  if bad then return nil, { 'invalid', bad } end
  local f = rcall('HMGET', kIdem(key), 'fp', 'kind', 'outcome')
  if not f[1] then return nil, nil end
  if f[1] ~= fp then return nil, { 'conflict' } end
  return { f[2], dec(f[3]) }, nil
end

local function remember(key, fp, kind, outcome, now)
  local expires = now + mmax(IDEM_RETENTION, P.ttl)
  rcall('HSET', kIdem(key), 'key', key, 'fp', fp, 'kind', kind, 'outcome', enc(outcome), 'expires', S(expires))
  timer_add(expires, '3|' .. key)
  mincr('nrec', 1)
end

---------------------------------------------------------------- replies

local function ok(changed, payload)
  return { 'OK', SEQ, I01(changed), unpack(payload) }
end
-- ('1' after the seq: this call changed the ledger before it refused, as Ledger::apply's
-- caller sees from the seq)
local function err(list)
  return { 'E', SEQ, B01(SEQ ~= SEQ0), unpack(list) }
end
local function text_refusal(code, scope, retry, msg)
  return { 'refused', code, scope, retry, 'text', msg }
end
-- (the operator's reason is not told to refused guests: CUTOFF_MESSAGE in the core)
local function cutoff_refusal()
  return text_refusal('cutoff_engaged', 'global', '60',
    'spending is paused by the operator; nothing new is admitted')
end

---------------------------------------------------------------- operations

local OPS = {}

-- args: run_id session conv input_bytes has_idem idem_key idem_fp n_ips (prefix factor)*
function OPS.admit_run(now, swept, A)
  local run_id, session, conv, input = A[1], A[2], A[3], N(A[4])
  local has_idem, ikey, ifp = A[5] == '1', A[6], A[7]
  local ips = {}
  for i = 1, N(A[8]) do ips[#ips + 1] = { A[7 + 2 * i], N(A[8 + 2 * i]) } end
  if has_idem then
    local rec, e = recall(ikey, ifp)
    if e then return err(e) end
    if rec then
      if rec[1] == 'run' then return ok(swept, rec[2]) end
      return err({ 'conflict' })
    end
  end
  local bad = check_id('run id', run_id) or check_id('session', session) or check_id('conversation', conv)
  if bad then return err({ 'invalid', bad }) end
  if #ips == 0 or #ips > 4 then return err({ 'invalid', 'one to four address prefixes' }) end
  for i, ip in ipairs(ips) do
    bad = check_id('address prefix', ip[1])
    if bad then return err({ 'invalid', bad }) end
    for j = 1, i - 1 do
      if ips[j][1] == ip[1] then return err({ 'invalid', 'address prefixes must be distinct' }) end
    end
  end
  if kv_get(kRun(run_id)) then return err({ 'invalid', 'run id already exists' }) end
  if records_held() >= RECORDS_MAX then return err({ 'full' }) end

  -- decide_run
  local outcome = nil
  local b = P.run
  local co = cutoff()
  if co then
    outcome = cutoff_refusal()
  elseif input > b['in'] then
    outcome = text_refusal('payload_too_large', 'run', '',
      'input of ' .. A[4] .. ' bytes is over the limit of ' .. S(b['in']) .. ' bytes')
  end
  local scopes = run_scopes(session, ips, conv)
  local now_us = now * 1000
  local tats, slots = {}, {}
  local left = nil -- RateLeft: { scope, remaining, reset_s }, the tightest
  local dry = nil -- the first refusal of a limit in dry-run
  if not outcome then
    for _, s in ipairs(scopes) do
      local kp = P.kinds[s[1]]
      if kp and kp.rate then
        local r = rate_scaled(kp.rate, s[3])
        local key = 'run|' .. disp(s[1], s[2])
        local good, v = rate_check(r, rate_get(key), now_us)
        if not good then
          local refusal = text_refusal('rate_limited', s[1], S(wait_secs(v)), s[1] .. ' request rate exceeded')
          if not kp.dry then
            outcome = refusal
            break
          end
          -- (the rate's state stays: a refused request would not have moved it)
          if not dry then dry = refusal end
        else
          tats[#tats + 1] = { key, v }
          local rem, reset = rate_left(r, v, now_us)
          if not left or rem < left[2] or (rem == left[2] and reset > left[3]) then
            left = { s[1], rem, reset }
          end
        end
      end
    end
  end
  if not outcome then
    for _, s in ipairs(scopes) do
      local kp = P.kinds[s[1]]
      if kp and kp.conc then
        local cap = mmin(kp.conc * s[3], 4294967295)
        local d = disp(s[1], s[2])
        local held = N(rcall('HGET', K_SLOTS, d) or '0')
        if held >= cap then
          local refusal = text_refusal('concurrency_limited', s[1], '1',
            s[1] .. ' already has ' .. S(held) .. ' active run(s) (limit ' .. S(cap) .. ')')
          if not kp.dry then
            outcome = refusal
            break
          end
          if not dry then dry = refusal end
        end
        slots[#slots + 1] = d
      end
    end
  end
  local counters = budget_counters(scopes, now)
  if not outcome then
    local need = 1
    if P.mode == 'whole_run' then need = b.cost end
    local bdry
    outcome, bdry = check_budgets(counters, need, now)
    if not dry then dry = bdry end
  end
  local admitted = false
  if not outcome then
    -- apply_run
    admitted = true
    for _, t in ipairs(tats) do rcall('ZADD', K_RATES, S(t[2]), t[1]) end
    for _, d in ipairs(slots) do rcall('HINCRBY', K_SLOTS, d, '1') end
    local deadline = now + b.secs * 1000
    local lease = mmin(now + P.ttl, deadline)
    local reserved, hid = 0, ''
    if P.mode == 'whole_run' then
      hid = run_id .. '.hold'
      hold(counters, b.cost)
      reserved = b.cost
      local encs = {}
      for _, k in ipairs(counters) do encs[#encs + 1] = k.enc end
      res_create(hid, { hid, run_id, 'hold', '', '0', '0', '0', '0', '0', b.cost, encs, 'held', 0, now, '', '', 0 })
    end
    local imm = imm_pack({ b['in'], b.ctx, b.out, b.trb, b.rounds, b.tools, b.retries, b.secs, b.cost, b.shrink,
      b.minout }, P.mode, { run_id, session, conv, ips, now, slots, hid })
    run_put(run_id, { 'active', deadline, lease, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, imm })
    timer_add(lease, '1|' .. run_id)
    mincr('nrec', 1)
    mincr('active', 1)
    outcome = { 'run_ok', run_id, S(deadline), S(reserved), S(b['in']), S(b.ctx), S(b.out), S(b.trb),
      S(b.rounds), S(b.tools), S(b.retries), S(b.secs), S(b.cost), S(b.shrink), S(b.minout) }
    -- rate_left: scope ('' = none), remaining, reset_s
    if left then
      outcome[#outcome + 1] = left[1]
      outcome[#outcome + 1] = S(left[2])
      outcome[#outcome + 1] = S(left[3])
    else
      outcome[#outcome + 1] = ''
      outcome[#outcome + 1] = '0'
      outcome[#outcome + 1] = '0'
    end
    add_dry(outcome, dry)
  end
  if has_idem then remember(ikey, ifp, 'run', outcome, now) end
  local changed = swept or admitted or has_idem
  if changed then bump() end
  return ok(changed, outcome)
end

-- args: run_id step_id has_idem idem_key idem_fp kind name ...
--   model: ip cp op prompt max_out('' = none) retry
--   tool: pc pu units
-- (a block: the main chunk's locals are at Lua's limit of 200)
do
-- Ledger::advance_for: the run a call is about, when its lease ran out behind more due timers
-- than one call processes, expires now, before the call looks at it.
local function lapse(id, now)
  local r = run_get(id)
  if r and r[R_STATE] == 'active' and r[R_LEASE] <= now then
    end_run(id, now, 'expired')
    bump()
    return true
  end
  return false
end
local function bound(msg) return text_refusal('run_bound_exceeded', 'run', '', msg) end
function OPS.reserve_step(now, swept, A)
  local run_id, step_id = A[1], A[2]
  local has_idem, ikey, ifp = A[3] == '1', A[4], A[5]
  local kind, name = A[6], A[7]
  if lapse(run_id, now) then swept = true end
  if has_idem then
    local rec, e = recall(ikey, ifp)
    if e then return err(e) end
    if rec then
      if rec[1] == 'step' then return ok(swept, rec[2]) end
      return err({ 'conflict' })
    end
  end
  local bad = check_id('step id', step_id)
  if bad then return err({ 'invalid', bad }) end
  local ks = kRes(step_id)
  kv_prefetch({ ks, kRun(run_id) })
  if kv_get(ks) then return err({ 'invalid', 'step id already exists' }) end
  local run = run_get(run_id)
  if not run then return err({ 'notfound', 'run ' .. run_id }) end
  local imm = run_imm(run, false)
  if records_held() >= RECORDS_MAX then return err({ 'full' }) end

  -- decide_step
  local outcome, plan = nil, nil
  local co = cutoff()
  if run[R_STATE] == 'finished' then
    outcome = bound('run is finished')
  elseif run[R_STATE] == 'expired' then
    outcome = bound('run deadline or lease has passed')
  elseif now >= run[R_DEADLINE] then
    outcome = bound('run deadline has passed')
  elseif co then
    outcome = cutoff_refusal()
  end
  local amount, max_out, retry = 0, nil, false
  local ip, cp, op, prompt_s
  if not outcome then
    if kind == 'model' then
      ip, cp, op, prompt_s = N(A[8]), N(A[9]), N(A[10]), A[11]
      retry = A[13] == '1'
      if retry and run[R_RETRIES] >= imm[R_B_RETRIES] then
        outcome = bound('run already used its ' .. S(imm[R_B_RETRIES]) .. ' retries')
      elseif not retry and run[R_ROUNDS] >= imm[R_B_ROUNDS] then
        outcome = bound('run already used its ' .. S(imm[R_B_ROUNDS]) .. ' model rounds')
      elseif N(prompt_s) > imm[R_B_CTX] then
        outcome = text_refusal('context_too_large', 'run', '',
          'prompt of ' .. prompt_s .. ' tokens is over the context limit of ' .. S(imm[R_B_CTX]) .. ' tokens')
      else
        max_out = imm[R_B_OUT]
        if A[12] ~= '' and N(A[12]) < max_out then max_out = N(A[12]) end
        amount = price_ceil({ { prompt_s, ip }, { S(max_out), op } })
      end
    else
      if run[R_TOOLS] >= imm[R_B_TOOLS] then
        outcome = bound('run already used its ' .. S(imm[R_B_TOOLS]) .. ' tool calls')
      else
        amount = tool_cost(N(A[8]), N(A[9]), A[10])
      end
    end
  end
  local counters
  if not outcome then
    if imm[R_MODE] == 'per_step' and P.scoped then
      imm = run_imm(run, true)
      counters = run_budget_counters(imm[R_SESSION], imm[R_IPS], imm[R_CONV], now)
    elseif imm[R_MODE] == 'per_step' then
      -- (no budget on an address prefix, session or conversation: the global ones only)
      counters = {}
      scope_counters(counters, 'global', '', 1, now)
    else
      counters = {}
    end
    -- (the run's own bound first, as the core: a step it can never fit is over the run's bound)
    table.insert(counters, 1, run_counter(run_id, imm[R_B_COST]))
    local refusal, dry = check_budgets(counters, amount, now)
    if not refusal then
      plan = { amount = amount, max_out = max_out, shrunk = false, dry = dry }
    else
      if imm[R_B_SHRINK] == 1 and kind == 'model' then
        -- (only enforced limits bound the output: a limit in dry-run never refuses)
        local room = nil
        for _, k in ipairs(counters) do
          if not is_dry(k.kind) then
            local r = remaining(cload(k.enc), k.limit)
            if room == nil or r < room then room = r end
          end
        end
        local fit = fit_output(prompt_s, ip, op, room or 0, max_out or 0)
        if fit and fit >= imm[R_B_MINOUT] then
          local a2 = price_ceil({ { prompt_s, ip }, { S(fit), op } })
          local r2, dry2 = check_budgets(counters, a2, now)
          if r2 then
            outcome = r2
          else
            plan = { amount = a2, max_out = fit, shrunk = true, dry = dry2 }
          end
        end
      end
      if not plan and not outcome then
        -- (a run bound its own steps in flight hold is a wait: budget_held)
        if refusal[3] == 'run' and refusal[2] == 'budget_exhausted' then
          outcome = { 'refused', 'run_bound_exceeded', 'run', '', 'runcost', S(imm[R_B_COST]) }
        else
          outcome = refusal
        end
      end
    end
  end
  if plan then
    -- apply_step
    hold(counters, plan.amount)
    local encs = {}
    for _, k in ipairs(counters) do encs[#encs + 1] = k.enc end
    local r
    if kind == 'model' then
      r = { step_id, run_id, 'model', name, A[8], A[9], A[10], B01(retry), '0', plan.amount, encs, 'held', 0, now, '',
        S(plan.max_out), 0 }
    else
      r = { step_id, run_id, 'tool', name, A[8], A[9], '0', '0', A[10], plan.amount, encs, 'held', 0, now, '', '', 0 }
    end
    res_create(step_id, r, true)
    local field = R_TOOLS
    if kind == 'model' then
      if retry then field = R_RETRIES else field = R_ROUNDS end
    end
    local rr = run_get(run_id)
    rr[field] = rr[field] + 1
    rcall('RPUSH', kSteps(run_id), step_id)
    rr[R_NSTEPS] = rr[R_NSTEPS] + 1
    rr[R_NHELD] = rr[R_NHELD] + 1
    run_put(run_id, rr)
    renew(run_id, now, P.ttl)
    local mo = ''
    if plan.max_out then mo = plan.max_out end
    outcome = { 'step_ok', step_id, plan.amount, mo, I01(plan.shrunk) }
    add_dry(outcome, plan.dry)
  end
  if has_idem then remember(ikey, ifp, 'step', outcome, now) end
  local changed = swept or plan ~= nil or has_idem
  if changed then bump() end
  return ok(changed, outcome)
end

-- args: step_id how ...; how = tokens uncached cached completion | units n | bytes n | release | unknown
function OPS.resolve(now, swept, A)
  local id, how = A[1], A[2]
  local f = res_get(id)
  if f and f[S_STATE] == 'held' then
    -- its run and counters, in one read (the lapse check below reads the run from it)
    local keys = { kRun(f[S_RUN]) }
    local cs = f[S_COUNTERS]
    for i = 1, #cs do
      if not run_of(cs[i]) then keys[#keys + 1] = kCounter(cs[i]) end
    end
    kv_prefetch(keys)
  end
  if f and lapse(f[S_RUN], now) then
    swept = true
    f = res_get(id)
  end
  if not f or f[S_KIND] == 'hold' then return err({ 'notfound', 'step ' .. id }) end
  local state, kind, amount = f[S_STATE], f[S_KIND], f[S_AMOUNT]
  if state ~= 'held' then
    local commit = how == 'tokens' or how == 'units' or how == 'bytes'
    -- Ledger::resolve's late overrun: a commit reaching an expired or unknown reservation
    -- with a usage that costs more than it was charged tops it up.
    if commit and (state == 'expired' or state == 'unknown') then
      local late = nil
      if kind == 'model' and how == 'tokens' then
        late = price_ceil({ { A[3], N(f[S_P1]) }, { A[4], N(f[S_P2]) }, { A[5], N(f[S_P3]) } })
      elseif kind == 'tool' and how == 'units' then
        late = tool_cost(N(f[S_P1]), N(f[S_P2]), A[3])
      end
      if late and late > f[S_CHARGED] then
        top_up(id, late, f)
        bump()
        return ok(true, { state, late, amount, I01(late > amount), 0, 0 })
      end
    end
    local same = (state == 'committed' and commit) or (state == 'released' and how == 'release')
      or (state == 'unknown' and how == 'unknown')
    if not same then return err({ 'closed', state, S(f[S_CHARGED]) }) end
    return ok(swept, { state, f[S_CHARGED], amount, f[S_OVERRUN], 1, f[S_BIG] })
  end
  local too_large = false
  if how == 'bytes' then
    local run = run_get(f[S_RUN])
    too_large = run and N(A[3]) > run_imm(run, false)[R_B_TRB] or false
  end
  local new, charged
  if how == 'release' then
    new, charged = 'released', 0
  elseif how == 'unknown' then
    new, charged = 'unknown', amount
  else
    new = 'committed'
    if kind == 'model' then
      if how ~= 'tokens' then return err({ 'invalid', 'a model step commits with "usage"' }) end
      charged = price_ceil({ { A[3], N(f[S_P1]) }, { A[4], N(f[S_P2]) }, { A[5], N(f[S_P3]) } })
    else
      if how == 'tokens' then
        return err({ 'invalid', 'a tool step commits with "units" or "result_bytes"' })
      elseif how == 'units' then
        charged = tool_cost(N(f[S_P1]), N(f[S_P2]), A[3])
      else
        charged = amount
      end
    end
  end
  f[S_BIG] = I01(too_large)
  settle(id, new, charged, now, nil, f)
  if charged > amount then top_up(id, nil, f) end
  renew(f[S_RUN], now, P.ttl)
  bump()
  return ok(true, { new, charged, amount, I01(charged > amount), 0, f[S_BIG] })
end

function OPS.heartbeat(now, swept, A)
  local id = A[1]
  if lapse(id, now) then swept = true end
  local run = run_get(id)
  if not run then return err({ 'notfound', 'run ' .. id }) end
  if run[R_STATE] ~= 'active' then return err({ 'runclosed', run[R_STATE] }) end
  local before = run[R_LEASE]
  local lease = renew(id, now, P.ttl) or before
  local changed = swept or lease ~= before
  if changed then bump() end
  return ok(changed, { lease, run[R_DEADLINE] })
end

function OPS.finish(now, swept, A)
  local id = A[1]
  if lapse(id, now) then swept = true end
  local run = run_get(id)
  if not run then return err({ 'notfound', 'run ' .. id }) end
  local state = run[R_STATE]
  local repeated = state ~= 'active'
  if not repeated then
    end_run(id, now, 'finished')
    bump()
    state = 'finished'
  end
  -- What the budgets were charged: whole_run, the hold's charge once it settled; per_step,
  -- the steps' sum (RunEnded::budgets_charged).
  local budgets = run[R_CHARGED]
  local hid = run_imm(run, true)[R_HOLD]
  if hid ~= '' then
    local h = res_get(hid)
    if h and h[S_STATE] ~= 'held' then budgets = h[S_CHARGED] end
  end
  return ok(swept or not repeated, { state, run[R_CHARGED], run[R_NSTEPS], I01(repeated), budgets })
end
end

-- args: n (prefix factor)*
function OPS.create_session(now, swept, A)
  local now_us = now * 1000
  local checks = {}
  if P.sc_ip then
    for i = 1, N(A[1]) do
      local prefix, factor = A[2 * i], mmax(N(A[2 * i + 1]), 1)
      local bad = check_id('address prefix', prefix)
      if bad then return err({ 'invalid', bad }) end
      checks[#checks + 1] = { 'create|ip:' .. prefix, rate_scaled(P.sc_ip, factor), 'ip' }
    end
  end
  if P.sc_global then checks[#checks + 1] = { 'create|global', P.sc_global, 'global' } end
  local tats, pressure = {}, false
  for _, c in ipairs(checks) do
    local good, v = rate_check(c[2], rate_get(c[1]), now_us)
    if good then
      if v - now_us > idiv(rate_tolerance(c[2]), 2) then pressure = true end
      tats[#tats + 1] = { c[1], v }
    else
      if swept then bump() end
      return ok(swept, text_refusal('rate_limited', c[3], S(wait_secs(v)),
        'session creation rate exceeded (' .. c[3] .. ')'))
    end
  end
  -- dry: only the answer a creation would get (the flag follows the address prefixes)
  if A[2 * N(A[1]) + 2] == '1' then
    if swept then bump() end
    return ok(swept, { 'session_ok', B01(pressure) })
  end
  for _, t in ipairs(tats) do rcall('ZADD', K_RATES, S(t[2]), t[1]) end
  bump()
  return ok(true, { 'session_ok', B01(pressure) })
end

local function scope_args(A, from)
  local scopes = {}
  for i = 1, N(A[from]) do
    local j = from + 3 * (i - 1)
    scopes[#scopes + 1] = { A[j + 1], A[j + 2], N(A[j + 3]) }
  end
  return scopes
end

local function lines(scopes, now)
  local out = {}
  for _, k in ipairs(budget_counters(scopes, now)) do
    local c = cload(k.enc)
    local _, _, _, id = string.match(k.enc, '^([^|]*)|([^|]*)|([^|]*)|(.*)$')
    out[#out + 1] = { k.kind, id, k.window, S(k.index), S(k.limit), S(c.used), S(c.reserved), S(c.overrun) }
  end
  return out
end

function OPS.set_cutoff(now, swept, A)
  local engaged, reason = A[1] == '1', A[2]
  local old = cutoff()
  local changed
  if engaged then
    changed = old ~= reason
    CUT = reason
    MDIRTY = true
  else
    changed = old ~= false
    CUT = false
    MDIRTY = true
  end
  if changed or swept then bump() end
  return ok(changed or swept, { B01(engaged) })
end

do -- (a block of its own: the main chunk is at Lua's 200-locals limit)
  -- Records single-use `key` (with what it was used for, `fp`) until `expires`
  -- (Ledger::mark_used); false when the ledger is full.
  local function mark_used(key, fp, expires)
    if records_held() >= RECORDS_MAX then return false end
    rcall('HSET', kIdem(key), 'key', key, 'fp', fp, 'kind', 'used', 'outcome', '', 'expires', S(expires))
    timer_add(expires, '3|' .. key)
    mincr('nrec', 1)
    return true
  end

  -- args: kind id amount factor (a wider address prefix's limit factor) once ('' = none)
  function OPS.adjust(now, swept, A)
    local kind, id, amount = A[1], A[2], N(A[3])
    if kind == 'run' then return err({ 'invalid', 'adjust a run through its steps' }) end
    local factor = mmax(N(A[4]) or 1, 1)
    local scopes = { { kind, id, factor } }
    local counters = budget_counters(scopes, now)
    if #counters == 0 then return err({ 'invalid', 'no budget applies to ' .. disp(kind, id) }) end
    -- once: applied once per key (Ledger::adjust); a repeat answers the lines as they are
    local once = A[5] or ''
    if once ~= '' then
      local bad = check_id('adjustment key', once)
      if bad then return err({ 'invalid', bad }) end
      local key = 'once:adjust:' .. once
      local fp = disp(kind, id) .. '|' .. S(factor) .. '|' .. A[3]
      local seen = rcall('HGET', kIdem(key), 'fp')
      if seen then
        if seen ~= fp then return err({ 'conflict' }) end
        if swept then bump() end
        local out = { '1' }
        for _, l in ipairs(lines(scopes, now)) do out[#out + 1] = l end
        return ok(swept, out)
      end
      if not mark_used(key, fp, now + 86400000) then return err({ 'full' }) end -- ADJUSTMENT_KEY_TTL_MS
    end
    for _, k in ipairs(counters) do
      local c = cload(k.enc)
      c.limit = k.limit
      local before = c.used
      if amount >= 0 then
        c.used = mmin(c.used + amount, MAX)
      else
        c.used = c.used - mmin(-amount, c.used)
      end
      -- what was applied (a credit stops at zero), so that used = charges + adjustments
      c.adjusted = c.adjusted + (c.used - before)
      if mmin(c.used + c.reserved, MAX) > c.limit then c.overrun = 1 end
      csave(c)
    end
    bump()
    local out = { '0' }
    for _, l in ipairs(lines(scopes, now)) do out[#out + 1] = l end
    return ok(true, out)
  end

  do
    local SWEEP_EXPIRIES = 256
    local SWEEP_BATCH = 1024
    function OPS.sweep(now, swept, A)
      local n = expire_due(now, SWEEP_EXPIRIES)
      local now_us = now * 1000
      local idle = rcall('ZRANGEBYSCORE', K_RATES, '-inf', S(now_us), 'LIMIT', '0', S(SWEEP_BATCH))
      for _, k in ipairs(idle) do rcall('ZREM', K_RATES, k) end
      local stale = rcall('ZRANGEBYSCORE', K_CWIN, '-inf', S(now - RETENTION), 'LIMIT', '0', S(SWEEP_BATCH))
      for _, e in ipairs(stale) do
        local f = cread(e)
        if not f then
          rcall('ZREM', K_CWIN, e)
        elseif f[3] == 0 then
          cdel(e)
          n = n + 1
        end
      end
      return ok(n > 0, { S(n) })
    end
  end

  -- args: key ttl_ms (Ledger::consume_once: single-use tokens share the idempotency records)
  function OPS.consume_once(now, swept, A)
    local bad = check_id('single-use key', A[1])
    if bad then return err({ 'invalid', bad }) end
    local key = 'once:' .. A[1]
    if rcall('EXISTS', kIdem(key)) == 1 then return ok(swept, { '0' }) end
    if not mark_used(key, '', now + N(A[2])) then return err({ 'full' }) end
    bump()
    return ok(true, { '1' })
  end
end

---------------------------------------------------------------- replicas

-- Replicas and their policy fingerprints (spendgate_core::replicas): a hash under the base,
-- replica id -> 'fingerprint|seen'. Presence, not ledger: no seq, no expiries, no meta write
-- (`announce` is called by `main` directly, never in a batch). The bounds are the core's:
-- REPLICAS_MAX and REPLICA_STALE_MS.
do
  local REPLICAS_MAX, REPLICA_STALE_MS = 128, 15000
  local ID_BAD, FP_BAD = '[^0-9A-Za-z%.%-_:]', '[^0-9A-Za-z]'

  -- The live entries of HGETALL's answer `all` at `now`: { id, fingerprint, seen }; with
  -- `drop`, stale and malformed ones are deleted.
  local function live_rows(all, now, drop, k)
    local rows = {}
    for i = 1, #all, 2 do
      local fp, seen = string.match(all[i + 1], '^([0-9A-Za-z]+)|(%d+)$')
      if fp and N(seen) + REPLICA_STALE_MS > now then
        rows[#rows + 1] = { all[i], fp, N(seen) }
      elseif drop then
        rcall('HDEL', k, all[i])
      end
    end
    return rows
  end

  local function answer(rows)
    local out = {}
    for i, r in ipairs(rows) do out[i] = { r[1], r[2], S(r[3]) } end
    return { 'OK', S(SEQ), out }
  end

  -- args: replica fingerprint (Command::Announce)
  function OPS.announce(now, A)
    local id, fp = A[1], A[2]
    if #id < 1 or #id > 128 or string.find(id, ID_BAD) then
      return err({ 'invalid', "replica id must be 1 to 128 bytes of letters, digits, '.', '-', '_' or ':'" })
    end
    if #fp < 1 or #fp > 64 or string.find(fp, FP_BAD) then
      return err({ 'invalid', 'policy fingerprint must be 1 to 64 letters or digits' })
    end
    local k = B .. ':rp'
    local others = {}
    for _, r in ipairs(live_rows(rcall('HGETALL', k), now, true, k)) do
      if r[1] ~= id then others[#others + 1] = r end
    end
    rcall('HSET', k, id, fp .. '|' .. S(now))
    -- Over the bound, the least recently seen others go (ties: any of them).
    while #others + 1 > REPLICAS_MAX do
      local oi = 1
      for j = 2, #others do
        if others[j][3] < others[oi][3] then oi = j end
      end
      rcall('HDEL', k, others[oi][1])
      table.remove(others, oi)
    end
    others[#others + 1] = { id, fp, now }
    return answer(others)
  end

  -- Command::Replicas (read-only: stale entries are skipped, dropped by the next announce)
  function OPS.replicas_read(now)
    return answer(live_rows(rcall('HGETALL', B .. ':rp'), now, false, nil))
  end
end

---------------------------------------------------------------- reads
local READS = {}
do
  local TIES_MAX = 10000

  local function top_with_ties(z, n)
    if n <= 0 then return {} end
    local r = rcall('ZREVRANGE', z, '0', S(n - 1), 'WITHSCORES')
    local seen, out = {}, {}
    for i = 1, #r, 2 do
      seen[r[i]] = true
      out[#out + 1] = r[i]
    end
    if #r / 2 == n then
      local thr = r[#r]
      for _, m in ipairs(rcall('ZRANGEBYSCORE', z, thr, thr, 'LIMIT', '0', S(TIES_MAX))) do
        if not seen[m] then
          seen[m] = true
          out[#out + 1] = m
        end
      end
    end
    return out
  end

  -- The n highest of index `base:part` with ties, or with part '' of every such index: there is
  -- no index of all parts (it would cost a write per change); the union of each part's top n
  -- with ties holds the overall top n with ties, and the caller sorts and truncates.
  local RES_STATES = { 'held', 'committed', 'released', 'unknown', 'expired' }
  local SCOPE_KINDS = { 'global', 'ip', 'session', 'conversation', 'run' }
  local function listing(base, part, parts, n)
    if part ~= '' then return top_with_ties(base .. ':' .. part, n) end
    local out = {}
    for _, p in ipairs(parts) do
      for _, m in ipairs(top_with_ties(base .. ':' .. p, n)) do out[#out + 1] = m end
    end
    return out
  end
  -- The top counters of a kind ('' = all kinds): global counters are not ranked (see csave),
  -- so all of them are listed (a superset of their top n, which the caller sorts and truncates).
  local function top_listing(part, n)
    if part == 'global' then
      if n <= 0 then return {} end
      return rcall('SMEMBERS', K_GLOBALS)
    end
    if part ~= '' then return top_with_ties(K_TOP .. ':' .. part, n) end
    local out = top_listing('global', n)
    for _, p in ipairs(SCOPE_KINDS) do
      if p ~= 'global' then
        for _, m in ipairs(top_with_ties(K_TOP .. ':' .. p, n)) do out[#out + 1] = m end
      end
    end
    return out
  end


  function READS.check(now, A)
    return { 'OK', S(SEQ) }
  end

  -- (defined with `announce` above, a read)
  READS.replicas, OPS.replicas_read = OPS.replicas_read, nil

  function READS.usage(now, A)
    return { 'OK', S(SEQ), lines(scope_args(A, 1), now) }
  end

  function READS.summary(now, A)
    local out = { 'OK', S(SEQ) }
    if CUT then
      out[3] = '1'
      out[4] = CUT
    else
      out[3] = '0'
      out[4] = ''
    end
    for i = 3, 8 do out[#out + 1] = S(MV[i]) end
    out[#out + 1] = msum(11)
    out[#out + 1] = msum(13)
    out[#out + 1] = S(MV[9])
    return out
  end


  -- args: state ('' = all) limit
  function READS.reservations(now, A)
    local ids = listing(K_RZ, A[1], RES_STATES, N(A[2]))
    local rows = {}
    for _, id in ipairs(ids) do
      local r = res_get(id)
      if r then
        local resolved = r[S_RESOLVED]
        if resolved ~= '' then resolved = S(resolved) end
        rows[#rows + 1] = { r[S_ID], r[S_RUN], r[S_KIND], r[S_NAME], r[S_P1], r[S_P2], r[S_P3], r[S_RETRY], r[S_UNITS],
          S(r[S_AMOUNT]), enc(r[S_COUNTERS]), r[S_STATE], S(r[S_CHARGED]), S(r[S_CREATED]), resolved, r[S_MAXOUT],
          S(r[S_OVERRUN]), S(r[S_BIG]) }
      end
    end
    return { 'OK', S(SEQ), rows }
  end

  -- args: kind ('' = all) top
  function READS.top(now, A)
    local rows = {}
    for _, e in ipairs(top_listing(A[1], N(A[2]))) do
      local f = cread(e)
      if f then rows[#rows + 1] = { e, S(f[1]), S(f[2]), S(f[3]), S(f[4]), S(f[5]) } end
    end
    return { 'OK', S(SEQ), rows }
  end
end

---------------------------------------------------------------- dispatch

-- One operation, its changes written before it answers.
local function run_op(op, now, A)
  if READS[op] then
    local reply = READS[op](now, A)
    RC = clear(RC)
    return reply
  end
  local f = OPS[op]
  -- Ledger::advance: the clock never goes back; due expiries are processed first (a sweep
  -- processes and counts them itself).
  local swept = false
  if op ~= 'sweep' then swept = expire_due(now, EXPIRIES_PER_CALL) > 0 end
  local reply = f(now, swept, A)
  run_flush()
  kv_flush()
  if now ~= MV[1] then meta_flush(now) else meta_flush(nil) end
  return reply
end

local function main(KEYS, ARGV)
  if not rcall then
    rcall, spack, sunpack, ssub, sfmt, tconcat = redis.call, struct.pack, struct.unpack, string.sub, string.format,
      table.concat
    mfloor, mmin, mmax = math.floor, math.min, math.max
  end
  set_base(KEYS[1])
  local op = ARGV[1]
  local A = { unpack(ARGV, 6) }

  local now
  if ARGV[2] == '' then
    local t = rcall('TIME')
    now = N(t[1]) * 1000 + idiv(N(t[2]), 1000)
  else
    now = N(ARGV[2])
  end

  -- The ledger's identity: 'ledger' (its id, written once by `spendgate store init` and
  -- pinned in every replica's config) and the epoch ('epoch', 'epoch_kind', 'epoch_at'),
  -- which changes at every accepted reset. Replicas read them (epoch_init) and never write
  -- them; only the operator's commands do (ledger_create, epoch_reset), each after checking,
  -- in the same call, that what it replaces is what the operator was shown.
  if op == 'epoch_init' then
    -- Read: the epoch, its kind, the seq, its time and the ledger id; or, where no epoch is,
    -- whether any ledger key is there (a Redis that came back empty looks exactly like a new
    -- deployment, so no replica may take one for the other).
    local f = rcall('HMGET', K_META, 'epoch', 'epoch_kind', 'm', 'epoch_at', 'ledger')
    local seq = '0'
    if f[3] then seq = S(sunpack('<d', f[3])) end
    if f[1] then return { 'OK', f[1], f[2] or 'init', seq, f[4] or '0', f[5] or '' } end
    local any = rcall('EXISTS', K_META, K_TIMERS, K_RATES, K_SLOTS, K_TOP, K_CWIN, K_RZ, K_GLOBALS)
    return { 'X', 'epoch_missing', any > 0 and '1' or '0' }
  end
  if op == 'ledger_create' then
    -- A[1] = new epoch id, A[2] = new ledger id, A[3] = the epoch the operator's command
    -- found ('' = none: the prefix must still be empty), A[4] = 'adopt' (give the ledger
    -- there, made before ledger ids, this id; its epoch stays) or 'new' (a new ledger: a new
    -- epoch and id, over what the prefix holds).
    local f = rcall('HMGET', K_META, 'epoch', 'ledger')
    if (f[1] or '') ~= A[3] then return { 'X', 'changed' } end
    if A[3] == '' then
      if rcall('EXISTS', K_META, K_TIMERS, K_RATES, K_SLOTS, K_TOP, K_CWIN, K_RZ, K_GLOBALS) > 0 then
        return { 'X', 'changed' }
      end
    end
    if A[4] == 'adopt' then
      if A[3] == '' or f[2] then return { 'X', 'changed' } end
      rcall('HSET', K_META, 'ledger', A[2])
    else
      rcall('HSET', K_META, 'epoch', A[1], 'epoch_kind', 'init', 'epoch_at', S(now), 'ledger', A[2])
    end
    return { 'OK' }
  end
  if op == 'epoch_reset' then
    -- A[1] = new epoch id, A[2] = the pinned ledger id: a reset acknowledges a rollback of
    -- that ledger, never an emptied prefix or another ledger.
    local f = rcall('HMGET', K_META, 'epoch', 'ledger')
    if not f[1] then return { 'X', 'epoch_missing' } end
    if f[2] ~= A[2] then return { 'X', 'ledger_mismatch', f[2] or '' } end
    rcall('HSET', K_META, 'epoch', A[1], 'epoch_kind', 'reset', 'epoch_at', S(now))
    local m = rcall('HGET', K_META, 'm')
    local seq = '0'
    if m then seq = S(sunpack('<d', m)) end
    return { 'OK', A[1], 'reset', seq, S(now) }
  end

  -- The epoch lives in the meta hash: one read checks it and loads the ledger's meta.
  local meta = rcall('HMGET', K_META, 'epoch', 'm', 'epoch_kind', 'epoch_at')
  if not meta[1] then return { 'X', 'epoch_missing' } end
  if meta[1] ~= ARGV[3] then
    return { 'X', 'epoch_changed', meta[1], meta[3] or 'init', meta[4] or '0', rcall('HGET', K_META, 'ledger') or '' }
  end
  meta_unpack(meta[2])
  if meta[3] == 'rolled_back' then return { 'X', 'rolled_back', S(SEQ) } end
  if SEQ < N(ARGV[4]) then
    -- Marked in Redis, so that every replica (a restarted one too) refuses until an operator
    -- accepts the reset, not only those that saw a higher seq. (A read-only call cannot
    -- write: the replica's next write call marks it.)
    redis.pcall('HSET', K_META, 'epoch_kind', 'rolled_back')
    return { 'X', 'rolled_back', S(SEQ) }
  end
  local clock = MV[1]
  if now < clock then now = clock end
  CC, RUNS, RDIRTY = clear(CC), clear(RUNS), clear(RDIRTY)
  -- (left over by a call that failed half way)
  if WBN > 0 or next(RC) then RC, WB, WBN = {}, {}, 0 end

  -- (presence, not ledger: no expiries, no meta write)
  if op == 'announce' then return OPS.announce(now, A) end

  P = policy(ARGV[5])

  if op ~= 'batch' then
    if not READS[op] and not OPS[op] then return redis.error_reply('spendgate: unknown operation ' .. op) end
    return run_op(op, now, A)
  end
  -- A batch (Store::execute_many): ARGV[6..] holds, for each command in turn, its operation,
  -- its number of arguments and those. Each is applied on its own, as if called alone at the
  -- same instant (its changes are written before the next one starts); the answer lists each
  -- one's answer.
  local cmds, i = {}, 6
  while i <= #ARGV do
    local sop, n = ARGV[i], N(ARGV[i + 1])
    if not n or (not READS[sop] and not OPS[sop]) or sop == 'announce' then
      return redis.error_reply('spendgate: bad batch at argument ' .. S(i))
    end
    cmds[#cmds + 1] = { sop, i + 2, i + 1 + n }
    i = i + 2 + n
  end
  local out = {}
  for j, c in ipairs(cmds) do out[j] = run_op(c[1], now, { unpack(ARGV, c[2], c[3]) }) end
  return out
end

redis.register_function { function_name = 'SPENDGATE_FN', callback = main }
redis.register_function { function_name = 'SPENDGATE_FN_ro', callback = main, flags = { 'no-writes' } }
