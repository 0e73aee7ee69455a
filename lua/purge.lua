-- purge.lua: remove a record unless it is in flight (admin purge): its execution may still be
-- running, even past its lock (a replica cut off from this server renews it when it can).
--
-- Not a record script: it belongs to no script version (lua/v1, lua/v2), since it only reads
-- the state and lock fields every version writes alike, and it runs only on an operator's
-- request. Loaded with SCRIPT LOAD and called with EVALSHA like them, and it runs only
-- commands the record scripts run, so the least-privilege ACL user needs nothing more.
--
-- KEYS[1]  the record hash: <prefix>:{<tenant>:<hex hash>}
--
-- Reply:
--   1         removed
--   0         there was no record; nothing changed
--   {lock_ms} the record is in flight and lock_ms of its lock is left (0 once it lapsed, by
--             this server's clock, TIME); nothing changed
--
-- Transition:
--   in flight (lock running or lapsed)                 -> unchanged
--   anything else (released, completed, not a record)  -> absent
--   One atomic step: a read followed by a DEL could remove a claim made between the two, and
--   the execution holding it would lose its record (a retry would run the key beside it).

local key = KEYS[1]
local s, l, f = unpack(redis.call('HMGET', key, 's', 'l', 'f'))
if s == 'i' and f then
  local time = redis.call('TIME')
  local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
  local left = (tonumber(l) or 0) - now
  if left < 0 then
    left = 0
  end
  return {left}
end
return redis.call('DEL', key)
