-- worker_lease.lua: take or keep the lease on one Snowflake worker id.
--
-- Not a record script: it belongs to no script version (lua/v1, lua/v2) and runs every few
-- seconds per process. Loaded with SCRIPT LOAD and called with EVALSHA like them, and it runs
-- only commands the record scripts run, so the least-privilege ACL user needs nothing more.
--
-- KEYS[1]  the lease: <prefix>:worker:<id>, a hash (no hash tag; every record key has one)
-- ARGV[1]  the holder: a random token of the calling process and its host name
-- ARGV[2]  lease, milliseconds (decimal integer >= 1, sent to PEXPIRE as this text)
--
-- Reply:
--   {1, now_ms}  the caller holds the lease for ARGV[2] ms from now; now_ms is this server's
--                clock (TIME) in Unix milliseconds, so a caller whose clock runs behind can
--                issue its ids no earlier than that
--   0            another holder has it (or the key is no lease); nothing changed
--
-- Transition:
--   absent                  -> held by ARGV[1] (field h) for ARGV[2] ms
--   held by ARGV[1]         -> the same, its expiry moved to ARGV[2] ms from now
--   held by another holder  -> unchanged
--   A holder that renews too late finds its lease either still free (taken again, as if new)
--   or another's (0): it never takes over a lease someone else holds.

local key = KEYS[1]

local function held()
  local time = redis.call('TIME')
  return {1, tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)}
end

local found = redis.pcall('HMGET', key, 'h')
if found.err then
  -- Not a hash: some other key under this name, never overwritten. Any other error (an ACL
  -- that does not grant the key, say) is the caller's to see, not a lease held elsewhere.
  if string.find(found.err, 'WRONGTYPE', 1, true) then
    return 0
  end
  return found
end
local holder = found[1]
if not holder then
  -- A hash without the field is some other key too (PTTL -2: no key at all).
  if redis.call('PTTL', key) ~= -2 then
    return 0
  end
  redis.call('HSET', key, 'h', ARGV[1])
  redis.call('PEXPIRE', key, ARGV[2])
  return held()
end
if holder == ARGV[1] then
  redis.call('PEXPIRE', key, ARGV[2])
  return held()
end
return 0
