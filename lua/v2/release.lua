-- release.lua (v2): drop a claim so the next claim executes again, if the caller owns it.
--
-- Same contract and record layout as v1; v2 also stamps the record with its version (field v,
-- see claim.lua), which no script reads.
--
-- KEYS[1]  the record hash: <prefix>:{<tenant>:<hex hash>}
-- ARGV[1]  owner token of the caller (32 hex digits)
-- ARGV[2]  write id: random per call, the same on every send of it (a re-send after a
--          dropped connection, the active version's after a canary failed)
--
-- Reply:
--   1  applied (now, or by an earlier send of the same write id)
--   0  the caller is not the owner; nothing changed
--
-- Transition:
--   in flight, owned by ARGV[1] -> released (fingerprint, execution id and expiry kept)
--   anything else               -> unchanged

local VERSION = 'v2'

local key = KEYS[1]
local owner, write_id = ARGV[1], ARGV[2]
-- The write id is written in the same HSET as the state it proves: a record still in flight
-- under this caller carries it only if a version wrote the id alone and then failed, and is
-- released now.
local s, o, w = unpack(redis.call('HMGET', key, 's', 'o', 'w'))
if w == write_id and not (s == 'i' and o == owner) then
  return 1
end
if s ~= 'i' or o ~= owner then
  return 0
end
redis.call('HSET', key, 's', 'r', 'w', write_id, 'v', VERSION)
redis.call('HDEL', key, 'o', 'l')
return 1
