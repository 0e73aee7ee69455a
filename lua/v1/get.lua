-- get.lua (v1): read a record without changing it. Also the readiness probe's script path.
--
-- KEYS[1]  the record hash: <prefix>:{<tenant>:<hex hash>}
--
-- Reply:
--   nil (absent), or {fingerprint, execution_id, state, lock_ms, payload} as in claim.lua,
--   with life_ms after them for a completed record (as in claim.lua)
--
-- Transition: none. A script (not HMGET) because the lock's remaining time is judged by this
-- server's clock (TIME).

local rec = redis.call('HMGET', KEYS[1], 'f', 'x', 's', 'l', 'p')
local f, x, s, l, p = rec[1], rec[2], rec[3], rec[4], rec[5]
if not f then
  return false
end
local lock_left = 0
if s == 'i' then
  local time = redis.call('TIME')
  local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
  lock_left = math.max(0, (tonumber(l) or 0) - now)
end
if s == 'c' then
  return {f, x, s, 0, p or '', redis.call('PTTL', KEYS[1])}
end
return {f, x, s, lock_left, p or ''}
