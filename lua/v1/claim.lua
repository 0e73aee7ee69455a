-- claim.lua (v1): claim a record for execution, or read it, in one atomic step.
--
-- KEYS[1]  the record hash: <prefix>:{<tenant>:<hex hash>}
-- ARGV[1]  fingerprint of the request (32 raw bytes)
-- ARGV[2]  owner token of the claimer (32 hex digits)
-- ARGV[3]  execution id to keep if the record is created (decimal u64)
-- ARGV[4]  lock ttl, milliseconds (decimal integer >= 1, no sign or leading zeros)
-- ARGV[5]  record ttl, milliseconds (likewise)
-- ARGV[6]  optional: "renew" when the owner is renewing the lock of an execution still
--          running (see Transition)
--
-- Reply:
--   {1, execution_id}
--   {1, execution_id, "l"}   (taken over from another owner whose lock lapsed)
--       the caller now holds the claim; execution_id is the record's (old or new). The "l"
--       says the record was in flight under another owner whose lock had lapsed: that
--       execution's outcome is unknown, and the proxy logs and counts the takeover
--       (optional in the contract: a version that leaves it out goes uncounted)
--   {0, fingerprint, execution_id, state, lock_ms, payload}
--   {0, fingerprint, execution_id, state, lock_ms, payload, life_ms}   (completed records)
--       the record as it is, unchanged. state is "i" (in flight), "r" (released) or
--       "c" (completed); lock_ms is what is left of the lock (0 unless in flight);
--       payload is the encoded completion ("" unless completed); life_ms is what is left of
--       a completed record's life (PTTL), so the caller may keep a local copy no longer than
--       this one lives (optional in the contract: a version that leaves it out gets no copies)
--
-- Transition:
--   absent                                  -> in flight (fingerprint, ARGV[3] as execution id)
--   released, or in flight whose lock lapsed
--     (or held by this same owner: a retry)  -> in flight under ARGV[2], execution id kept,
--                                              only when the fingerprint matches
--   anything else                           -> unchanged
--   A renewal (ARGV[6] "renew") takes only a lock this owner holds, lapsed or not: a record
--   it released, or that another owner holds, is answered unchanged. Its renewal may reach
--   Redis after the release it raced (given up on, or sent on a connection that was then
--   replaced), and must not lock the key again for nobody. An absent record is created as
--   by a claim: the execution is still running. (Optional in the contract: a version that
--   ignores ARGV[6] renews as a claim does.)
--   A created or re-claimed record lives at least max(record ttl, lock ttl) from now; a
--   re-claim never shortens it. Lock lapse is judged by this server's clock (TIME), never the
--   proxy's.
--
-- Fields: f fingerprint, x execution id, s state, o owner, l lock deadline (ms, server clock),
-- p payload, w id of the last applied complete/release.
--
-- Numbers: every argument this script gives redis.call is a string. Redis 7.2.0-7.2.4 turn a
-- Lua number argument into text with fpconv_dtoa, which writes a whole number ending in 8 or
-- more zeros in exponent form (900000000 -> "9e+08", redis/redis#13113): PEXPIRE then fails with
-- "value is not an integer" after this script's writes, and the record is left without an
-- expiry. So a ttl goes on as the ARGV text the proxy sent, and the lock deadline as
-- string.format('%.0f'), exact for every integer below 2^53 ('%d' casts to a C long, 32 bits
-- on some builds).

local key = KEYS[1]
local fingerprint, owner, execution_id = ARGV[1], ARGV[2], ARGV[3]
local lock_ms, ttl_ms = tonumber(ARGV[4]), tonumber(ARGV[5])
-- The record's life: a number to compare with, and the same as text to send (see Numbers).
local life_ms, life = ttl_ms, ARGV[5]
if lock_ms > ttl_ms then
  life_ms, life = lock_ms, ARGV[4]
end
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local lock_until = string.format('%.0f', now + lock_ms)

local rec = redis.call('HMGET', key, 'f', 'x', 's', 'o', 'l', 'p', 'w')
local f, x, s, o, l, p, w = rec[1], rec[2], rec[3], rec[4], rec[5], rec[6], rec[7]

if not f then
  -- Absent. A hash without a fingerprint is no record any script writes: start afresh,
  -- clearing any fields a script would read. Only for such a hash: Redis at maxmemory (under
  -- noeviction) refuses a script's first write with OOM, but lets every write after it through,
  -- so a DEL first would let the HSET grow a full Redis (and the claim succeed while the
  -- completions that follow are refused).
  if x or s or o or l or p or w then
    redis.call('DEL', key)
  end
  redis.call('HSET', key, 'f', fingerprint, 'x', execution_id, 's', 'i', 'o', owner,
    'l', lock_until)
  redis.call('PEXPIRE', key, life)
  return {1, execution_id}
end

local lock_left = 0
if s == 'i' then
  lock_left = math.max(0, (tonumber(l) or 0) - now)
end
local free
if ARGV[6] == 'renew' then
  free = s == 'i' and o == owner
else
  free = s == 'r' or (s == 'i' and (lock_left == 0 or o == owner))
end
if free and f == fingerprint then
  redis.call('HSET', key, 's', 'i', 'o', owner, 'l', lock_until)
  if redis.call('PTTL', key) < life_ms then
    redis.call('PEXPIRE', key, life)
  end
  if s == 'i' and o ~= owner then
    return {1, x, 'l'}
  end
  return {1, x}
end
if s == 'c' then
  return {0, f, x, s, 0, p or '', redis.call('PTTL', key)}
end
return {0, f, x, s, lock_left, p or ''}
