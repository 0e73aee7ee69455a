//! Whether a Redis server behind the store was restarted or replaced since the last look, read
//! from `INFO server` every [`CHECK_EVERY`]: each server's `run_id`, which Redis draws anew at
//! every start, and on a Cluster the set of primaries (a failover puts another one in).
//!
//! A restarted server without persistence comes back empty, and a promoted replica may lack the
//! last writes of its primary: records this replica holds local copies of may be gone from
//! Redis, and their keys run again on any replica that asks Redis, while this one would go on
//! replaying its copies for their whole ttl. A lost connection tells a replica as much for a
//! single server (its purge channel is subscribed again, which drops the copies), but not for a
//! Cluster shard other than the one the channel is on, nor a Sentinel failover that left the
//! channel's server up as a replica. So the store drops its copies on any change of what this
//! reading finds.

use std::time::Duration;

use redis::Value;

/// How often the servers are read: a shard that lost its records is followed this soon at
/// most by the copies of them being dropped.
pub const CHECK_EVERY: Duration = Duration::from_secs(5);

/// Readings in a row that each found a change, after which the run ids are no longer followed:
/// an endpoint whose `INFO` answers from another server at each call (a proxy in front of
/// Redis) would otherwise drop the local copies every few seconds. Ten readings are 50 s of
/// changes without a pause, which a rolling restart (each server back and in sync before the
/// next goes) does not make.
pub const CHANGES_IN_A_ROW: u32 = 10;

/// The servers one reading found: each server's address (empty for the one server of a single
/// or Sentinel setup) and run id, sorted by address (a Cluster's replies come in no order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Servers(Vec<(String, String)>);

impl Servers {
    /// How many servers the reading covers.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether it covers none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::fmt::Display for Servers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (n, (node, run_id)) in self.0.iter().enumerate() {
            if n > 0 {
                f.write_str(", ")?;
            }
            match node.is_empty() {
                true => write!(f, "run_id {run_id}")?,
                false => write!(f, "{node} run_id {run_id}")?,
            }
        }
        Ok(())
    }
}

/// What a reading of the servers' run ids found, against the one before
/// ([`crate::store::RedisStore::check_restarts`]).
#[derive(Debug, PartialEq, Eq)]
pub enum Restarts {
    /// The same servers as at the last reading (or this is the first).
    Same,
    /// A server restarted, or another took its place (a failover).
    Changed { before: Servers, now: Servers },
    /// Not read this time (a server did not answer, or a Cluster reading left one out).
    Unknown,
    /// The ACL user may not run `INFO`.
    Denied(String),
}

/// What to do after a reading ([`Watch::after`]).
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// Nothing changed, or nothing could be told.
    Nothing,
    /// A server restarted or was replaced: drop the local copies.
    DropCopies,
    /// Stop reading: `INFO` is refused, or the run ids change at every reading.
    Stop,
}

/// Follows the readings: counts the changes in a row (see [`CHANGES_IN_A_ROW`]).
#[derive(Debug, Default)]
pub struct Watch {
    changes_in_a_row: u32,
}

impl Watch {
    /// What to do after the reading `found`.
    pub fn after(&mut self, found: &Restarts) -> Step {
        match found {
            Restarts::Changed { .. } => {
                self.changes_in_a_row += 1;
                if self.changes_in_a_row >= CHANGES_IN_A_ROW {
                    Step::Stop
                } else {
                    Step::DropCopies
                }
            }
            Restarts::Denied(_) => Step::Stop,
            Restarts::Same | Restarts::Unknown => {
                self.changes_in_a_row = 0;
                Step::Nothing
            }
        }
    }
}

/// What one reading of `INFO server` found.
#[derive(Debug, PartialEq, Eq)]
pub enum Reading {
    /// Every server's run id (each primary's, on a Cluster).
    Servers(Servers),
    /// The ACL user may not run `INFO` (`NOPERM`).
    Denied(String),
    /// A reply without a run id, an error from some server, or of another shape.
    Unreadable(String),
}

/// Reads the reply of `INFO server`: one server's text, or (Cluster) a map from each primary's
/// address to its text or its error.
pub fn read(reply: Value) -> Reading {
    let mut servers = Vec::new();
    match reply {
        Value::Map(nodes) => {
            for (node, reply) in nodes {
                let node = super::eviction::text_of(&node).unwrap_or_default();
                match reply {
                    Value::ServerError(e) if e.code() == "NOPERM" => {
                        return Reading::Denied(format!("{node}: {e}"));
                    }
                    reply => match run_id(&reply) {
                        Some(id) => servers.push((node, id)),
                        None => return Reading::Unreadable(format!("{node}: {reply:?}")),
                    },
                }
            }
        }
        reply => match run_id(&reply) {
            Some(id) => servers.push((String::new(), id)),
            None => return Reading::Unreadable(format!("{reply:?}")),
        },
    }
    servers.sort();
    Reading::Servers(Servers(servers))
}

fn run_id(reply: &Value) -> Option<String> {
    let text = super::eviction::text_of(reply)?;
    text.lines()
        .find_map(|line| line.strip_prefix("run_id:"))
        .map(str::trim)
        .filter(|id| !id.is_empty())
        .map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn one_server_and_a_cluster_s_primaries_are_read_in_address_order() {
        let one = read(text(
            "# Server\r\nredis_version:7.0.15\r\nrun_id:abc\r\ntcp_port:6379\r\n",
        ));
        assert_eq!(
            one,
            Reading::Servers(Servers(vec![(String::new(), "abc".into())]))
        );
        let cluster = read(Value::Map(vec![
            (text("127.0.0.1:7002"), text("run_id:b2\r\n")),
            (text("127.0.0.1:7001"), text("run_id:a1\r\n")),
        ]));
        let Reading::Servers(servers) = cluster else {
            panic!("{cluster:?}");
        };
        assert_eq!(
            servers.to_string(),
            "127.0.0.1:7001 run_id a1, 127.0.0.1:7002 run_id b2"
        );
    }

    /// A restart drops the copies; an endpoint whose run id changes at every reading (a proxy
    /// answering from another server each time) is no longer followed, once it has changed for
    /// longer than a rolling restart does without a pause.
    #[test]
    fn changes_drop_copies_until_they_come_at_every_reading() {
        let servers = |id: &str| Servers(vec![(String::new(), id.to_owned())]);
        let changed = || Restarts::Changed {
            before: servers("a"),
            now: servers("b"),
        };
        let mut watch = Watch::default();
        assert_eq!(watch.after(&Restarts::Same), Step::Nothing);
        assert_eq!(watch.after(&changed()), Step::DropCopies);
        assert_eq!(watch.after(&Restarts::Same), Step::Nothing);
        for _ in 1..CHANGES_IN_A_ROW {
            assert_eq!(watch.after(&changed()), Step::DropCopies);
        }
        assert_eq!(watch.after(&changed()), Step::Stop);
        let mut refused = Watch::default();
        assert_eq!(
            refused.after(&Restarts::Denied("NOPERM".into())),
            Step::Stop
        );
    }

    #[test]
    fn a_reply_without_a_run_id_or_with_an_error_is_no_reading() {
        assert!(matches!(
            read(text("redis_version:7\r\n")),
            Reading::Unreadable(_)
        ));
        assert!(matches!(read(Value::Nil), Reading::Unreadable(_)));
        let refused = redis::parse_redis_value(b"-NOPERM no\r\n").unwrap();
        assert!(matches!(
            read(Value::Map(vec![(text("n"), refused)])),
            Reading::Denied(_)
        ));
        let down = redis::parse_redis_value(b"-ERR down\r\n").unwrap();
        assert!(matches!(
            read(Value::Map(vec![
                (text("a"), text("run_id:x\r\n")),
                (text("n"), down)
            ])),
            Reading::Unreadable(_)
        ));
    }
}
