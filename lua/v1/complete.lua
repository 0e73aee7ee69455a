-- complete.lua (v1): store how an execution ended, if the caller still owns the claim.
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

-- The write id is written in the same HSET as the state it proves: a record that carries it
-- but is not completed was never completed by this call (a version that wrote the id alone and
-- then failed), and is judged by its owner like any other.

local key = KEYS[1]
local rec = redis.call('HMGET', key, 's', 'o', 'w')
if rec[3] == ARGV[4] and rec[1] == 'c' then
  -- Applied before. A send that failed half-way (a canary's script error after its HSET)
  -- left the claim's fields and expiry: finish what it began.
  if rec[2] then
    redis.call('HDEL', key, 'o', 'l')
    redis.call('PEXPIRE', key, ARGV[3])
  end
  return 1
end
if rec[1] ~= 'i' or rec[2] ~= ARGV[1] then
  return 0
end
redis.call('HSET', key, 's', 'c', 'p', ARGV[2], 'w', ARGV[4])
redis.call('HDEL', key, 'o', 'l')
redis.call('PEXPIRE', key, ARGV[3])
return 1
