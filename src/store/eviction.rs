//! Whether Redis may evict records, read from `INFO memory` (`maxmemory`, `maxmemory_policy`)
//! once the store is connected and every [`CHECK_EVERY`] after.
//!
//! Every record carries a ttl, so every policy but `noeviction` may drop one under memory
//! pressure: the `volatile-*` policies (the default of several managed Redis offerings) as much
//! as the `allkeys-*` ones. A dropped in-flight record lets a duplicate execute; a dropped
//! completed one makes its retry run again. idemgate cannot prevent that; it says so, with a
//! warning and `idemgate_store_redis_may_evict`.

use std::time::Duration;

use redis::Value;

/// How often the setting is read again: a `CONFIG SET`, or a failover to a server configured
/// otherwise, changes it while idemgate runs.
pub const CHECK_EVERY: Duration = Duration::from_secs(60);

/// One server's memory limit and eviction policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setting {
    /// The server: a Cluster primary's address, empty for a single server.
    pub node: String,
    /// `maxmemory` in bytes; 0 is no limit.
    pub maxmemory: u64,
    /// `maxmemory-policy`.
    pub policy: String,
}

impl Setting {
    /// Whether this server may evict a record: a memory limit, under any policy but
    /// `noeviction`. (Without a limit nothing is evicted, whatever the policy says.)
    pub fn may_evict(&self) -> bool {
        self.maxmemory > 0 && self.policy != "noeviction"
    }
}

impl std::fmt::Display for Setting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "maxmemory-policy {} with maxmemory {}",
            self.policy, self.maxmemory
        )?;
        if !self.node.is_empty() {
            write!(f, " on {}", self.node)?;
        }
        Ok(())
    }
}

/// What one reading of `INFO memory` found.
#[derive(Debug, PartialEq, Eq)]
pub enum Reading {
    /// Every server's setting (each primary's, on a Cluster).
    Settings(Vec<Setting>),
    /// The ACL user may not run `INFO` (`NOPERM`).
    Denied(String),
    /// A reply without the two fields, or of another shape.
    Unreadable(String),
}

/// Reads the reply of `INFO memory`: one server's text, or (Cluster) a map from each primary's
/// address to its text or its error.
pub fn read(reply: Value) -> Reading {
    match reply {
        Value::Map(nodes) => {
            let mut settings = Vec::with_capacity(nodes.len());
            for (node, reply) in nodes {
                let node = text_of(&node).unwrap_or_default();
                match reply {
                    Value::ServerError(e) if e.code() == "NOPERM" => {
                        return Reading::Denied(format!("{node}: {e}"));
                    }
                    reply => match setting(node, &reply) {
                        Ok(s) => settings.push(s),
                        Err(why) => return Reading::Unreadable(why),
                    },
                }
            }
            Reading::Settings(settings)
        }
        reply => match setting(String::new(), &reply) {
            Ok(s) => Reading::Settings(vec![s]),
            Err(why) => Reading::Unreadable(why),
        },
    }
}

/// What the readings so far found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Finding {
    /// Not read yet, or `INFO` refused.
    #[default]
    Unknown,
    /// No server may evict records.
    Never,
    /// Some may: the evicting settings in one line, sorted by server (a Cluster's replies come
    /// in no fixed order), so that each change is told from the last.
    May(String),
}

impl Finding {
    /// `idemgate_store_redis_may_evict`: 1 some server may evict records, 0 none may, -1 not
    /// known.
    pub fn gauge(&self) -> i8 {
        match self {
            Finding::Unknown => -1,
            Finding::Never => 0,
            Finding::May(_) => 1,
        }
    }

    /// What a reading of `settings` finds, on a Cluster whose slots `primaries` own (when
    /// known); `None` keeps the last finding. A reading that left a primary out (redis-rs skips
    /// one it holds no connection to) can tell that some server may evict, not that none may.
    pub fn of(settings: &[Setting], primaries: Option<usize>) -> Option<Finding> {
        let mut evicting: Vec<&Setting> = settings.iter().filter(|s| s.may_evict()).collect();
        if evicting.is_empty() {
            let partial = primaries.is_some_and(|primaries| settings.len() < primaries);
            return (!partial).then_some(Finding::Never);
        }
        evicting.sort_by(|a, b| a.node.cmp(&b.node));
        let lines: Vec<String> = evicting.iter().map(ToString::to_string).collect();
        Some(Finding::May(lines.join("; ")))
    }
}

/// How many primaries own slots in a `CLUSTER SLOTS` reply (each range names its primary
/// third), or `None` for a reply of another shape. A fan-out of `INFO` leaves out a primary the
/// client holds no connection to (a dead one still owning its slots), so a reading with fewer
/// servers than this is not the whole Cluster's.
pub fn slot_primaries(reply: &Value) -> Option<usize> {
    let Value::Array(ranges) = reply else {
        return None;
    };
    let mut primaries = std::collections::BTreeSet::new();
    for range in ranges {
        let Value::Array(parts) = range else {
            return None;
        };
        let Some(Value::Array(primary)) = parts.get(2) else {
            return None;
        };
        // By node id (the third field): the host may be `?` or missing, depending on
        // `cluster-preferred-endpoint-type`.
        primaries.insert(primary.get(2).and_then(text_of)?);
    }
    Some(primaries.len())
}

/// One server's setting from its `INFO memory` text.
fn setting(node: String, reply: &Value) -> Result<Setting, String> {
    let Some(text) = text_of(reply) else {
        return Err(format!("INFO answered {reply:?}"));
    };
    let field = |name: &str| {
        text.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
    };
    let maxmemory = field("maxmemory").and_then(|v| v.parse().ok());
    match (maxmemory, field("maxmemory_policy")) {
        (Some(maxmemory), Some(policy)) if !policy.is_empty() => Ok(Setting {
            node,
            maxmemory,
            policy: policy.to_owned(),
        }),
        _ => Err(format!(
            "INFO memory{} has no maxmemory and maxmemory_policy",
            if node.is_empty() {
                String::new()
            } else {
                format!(" of {node}")
            }
        )),
    }
}

pub(super) fn text_of(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
        Value::SimpleString(text) | Value::VerbatimString { text, .. } => Some(text.clone()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(maxmemory: u64, policy: &str) -> String {
        format!(
            "# Memory\r\nused_memory:1024\r\nmaxmemory:{maxmemory}\r\nmaxmemory_human:1M\r\n\
             maxmemory_policy:{policy}\r\nallocator_frag_ratio:1.0\r\n"
        )
    }

    fn bulk(text: &str) -> Value {
        Value::BulkString(text.as_bytes().to_vec())
    }

    #[test]
    fn a_server_evicts_only_with_a_limit_and_a_policy_other_than_noeviction() {
        let cases = [
            (0, "volatile-lru", false),
            (1 << 20, "noeviction", false),
            (1 << 20, "volatile-lru", true),
            (1 << 20, "allkeys-lfu", true),
            (1 << 20, "volatile-ttl", true),
        ];
        for (maxmemory, policy, evicts) in cases {
            let Reading::Settings(settings) = read(bulk(&info(maxmemory, policy))) else {
                panic!("{maxmemory} {policy}");
            };
            assert_eq!(
                settings,
                [Setting {
                    node: String::new(),
                    maxmemory,
                    policy: policy.into()
                }]
            );
            assert_eq!(settings[0].may_evict(), evicts, "{maxmemory} {policy}");
        }
    }

    #[test]
    fn resp3_text_and_cluster_maps_are_read() {
        let verbatim = Value::VerbatimString {
            format: redis::VerbatimFormat::Text,
            text: info(100, "allkeys-lru"),
        };
        assert!(matches!(read(verbatim), Reading::Settings(s) if s[0].may_evict()));
        let cluster = Value::Map(vec![
            (bulk("10.0.0.1:7000"), bulk(&info(0, "noeviction"))),
            (bulk("10.0.0.2:7000"), bulk(&info(100, "volatile-lru"))),
        ]);
        let Reading::Settings(settings) = read(cluster) else {
            panic!("cluster");
        };
        let evicting: Vec<String> = settings
            .iter()
            .filter(|s| s.may_evict())
            .map(Setting::to_string)
            .collect();
        assert_eq!(
            evicting,
            ["maxmemory-policy volatile-lru with maxmemory 100 on 10.0.0.2:7000"]
        );
    }

    #[test]
    fn what_may_evict_is_described_the_same_whatever_the_reply_order() {
        let setting = |node: &str, maxmemory, policy: &str| Setting {
            node: node.into(),
            maxmemory,
            policy: policy.into(),
        };
        let a = setting("10.0.0.1:7000", 100, "volatile-lru");
        let b = setting("10.0.0.2:7000", 0, "volatile-lru");
        let c = setting("10.0.0.3:7000", 200, "allkeys-lru");
        let described = Finding::of(&[a.clone(), b.clone(), c.clone()], None);
        assert_eq!(
            described,
            Some(Finding::May(
                "maxmemory-policy volatile-lru with maxmemory 100 on 10.0.0.1:7000; \
                 maxmemory-policy allkeys-lru with maxmemory 200 on 10.0.0.3:7000"
                    .into()
            ))
        );
        assert_eq!(Finding::of(&[c, b.clone(), a.clone()], None), described);
        assert_eq!(
            Finding::of(std::slice::from_ref(&b), None),
            Some(Finding::Never)
        );
        // A reading that left primaries out tells an evicting one, never that none may.
        assert_eq!(Finding::of(std::slice::from_ref(&b), Some(3)), None);
        assert!(matches!(Finding::of(&[a], Some(3)), Some(Finding::May(_))));
        assert_eq!(Finding::of(&[b], Some(1)), Some(Finding::Never));
        let gauges: Vec<i8> = [
            Finding::Unknown,
            Finding::Never,
            Finding::May(String::new()),
        ]
        .iter()
        .map(Finding::gauge)
        .collect();
        assert_eq!(gauges, [-1, 0, 1]);
    }

    #[test]
    fn the_primaries_owning_slots_are_counted_once_each() {
        let node = |port: i64| {
            Value::Array(vec![
                bulk("127.0.0.1"),
                Value::Int(port),
                bulk(&format!("id-{port}")),
            ])
        };
        let range = |from, to, primary, replica| {
            Value::Array(vec![
                Value::Int(from),
                Value::Int(to),
                node(primary),
                node(replica),
            ])
        };
        // Three primaries, one of them owning two ranges after a reshard.
        let slots = Value::Array(vec![
            range(0, 99, 7001, 7004),
            range(100, 5460, 7000, 7003),
            range(5461, 10922, 7001, 7004),
            range(10923, 16383, 7002, 7005),
        ]);
        assert_eq!(slot_primaries(&slots), Some(3));
        assert_eq!(slot_primaries(&Value::Array(vec![])), Some(0));
        assert_eq!(slot_primaries(&Value::Nil), None);
        assert_eq!(slot_primaries(&Value::Array(vec![Value::Int(1)])), None);
    }

    #[test]
    fn a_refusal_and_odd_replies_are_told_apart() {
        let denied =
            redis::parse_redis_value(b"-NOPERM this user has no permissions to run 'info'\r\n")
                .expect("an error reply");
        assert!(matches!(denied, Value::ServerError(_)), "{denied:?}");
        let cluster = Value::Map(vec![
            (bulk("10.0.0.1:7000"), bulk(&info(0, "noeviction"))),
            (bulk("10.0.0.2:7000"), denied),
        ]);
        assert!(matches!(read(cluster), Reading::Denied(why) if why.starts_with("10.0.0.2:7000")));
        for odd in [
            Value::Nil,
            Value::Int(1),
            bulk("# Memory\r\nused_memory:1\r\n"),
            bulk("maxmemory:lots\r\nmaxmemory_policy:noeviction\r\n"),
            bulk("maxmemory:0\r\nmaxmemory_policy:\r\n"),
        ] {
            assert!(
                matches!(read(odd.clone()), Reading::Unreadable(_)),
                "{odd:?}"
            );
        }
    }
}
