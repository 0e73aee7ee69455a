-- get.lua (v2): read a record without changing it. Also the readiness probe's script path.
--
-- Same contract as v1; v2 asks the server clock only for records in flight.
--
-- KEYS[1]  the record hash: <prefix>:{<tenant>:<hex hash>}
--
-- Reply:
--   nil (absent), or {fingerprint, execution_id, state, lock_ms, payload} as in claim.lua,
--   with life_ms after them for a completed record (as in claim.lua)
--
-- Transition: none. A script (not HMGET) because the lock's remaining time is judged by this
-- server's clock (TIME).

local f, x, s, l, p = unpack(redis.call('HMGET', KEYS[1], 'f', 'x', 's', 'l', 'p'))
if not f then
  return false
end
if s == 'c' then
  return {f, x, s, 0, p or '', redis.call('PTTL', KEYS[1])}
end
if s ~= 'i' then
  return {f, x, s, 0, p or ''}
end
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
return {f, x, s, math.max(0, (tonumber(l) or 0) - now), p or ''}
