-- complete.lua (v2): store how an execution ended, if the caller still owns the claim.
--
-- Same contract and record layout as v1; v2 also stamps the record with its version (field v,
-- see claim.lua), which no script reads.
--
-- KEYS[1]  the record hash: <prefix>:{<tenant>:<hex hash>}
-- ARGV[1]  owner token of the caller (32 hex digits)
-- ARGV[2]  the encoded completion (see src/store/codec.rs)
-- ARGV[3]  record ttl from now, milliseconds (decimal integer >= 1, no sign or leading zeros;
--          it goes to PEXPIRE as this text, never as a Lua number: see claim.lua on numbers)
-- ARGV[4]  write id: one per owner and payload (a hash of the two), the same on
--          every send of this write: a re-send after a dropped connection, the active
--          version's after a canary failed, the completion retrier's attempts
--
-- Reply:
--   1  applied (now, or by an earlier send of the same write id)
--   0  the caller is not the owner; nothing changed
--
-- Transition:
--   in flight, owned by ARGV[1] (lock lapsed or not) -> completed (payload), lives ARGV[3] ms
--   anything else                                    -> unchanged
--   A lapsed owner may still complete until someone re-claims; after that the owner token no
--   longer matches (fencing). Completed records are immutable.

local VERSION = 'v2'

local key = KEYS[1]
local owner, payload, ttl_ms, write_id = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
-- The write id is written in the same HSET as the state it proves: a record that carries it
-- but is not completed was never completed by this call (a version that wrote the id alone and
-- then failed), and is judged by its owner like any other.
local s, o, w = unpack(redis.call('HMGET', key, 's', 'o', 'w'))
if w == write_id and s == 'c' then
  -- Applied before. A send that failed half-way (a canary's script error after its HSET)
  -- left the claim's fields and expiry: finish what it began.
  if o then
    redis.call('HDEL', key, 'o', 'l')
    redis.call('PEXPIRE', key, ttl_ms)
  end
  return 1
end
if s ~= 'i' or o ~= owner then
  return 0
end
redis.call('HSET', key, 's', 'c', 'p', payload, 'w', write_id, 'v', VERSION)
redis.call('HDEL', key, 'o', 'l')
redis.call('PEXPIRE', key, ttl_ms)
return 1
