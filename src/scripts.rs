//! Lua script sources of the Redis store: the versions compiled into the binary and versions
//! read from a directory (`store.redis.scripts.dir`, laid out `<dir>/<version>/<script>.lua`).
//!
//! Text only. Loading a version into Redis (SCRIPT LOAD, which is also where a syntax error
//! shows) is the store's business; this module lets the config check that a named version
//! exists without knowing Redis, and lets the store and the script watcher read the text.
//!
//! Lookup of a version: `<dir>/<version>/` when that directory exists (all four files must be
//! there: a version is never half from disk and half built in), else the built-in version of
//! that name, else an error. So a directory may override a built-in version or add new ones.

use std::fmt;
use std::path::{Path, PathBuf};

/// The four scripts of every version, in the order [`Sources::texts`] holds them.
pub const SCRIPT_NAMES: [&str; 4] = ["claim", "complete", "release", "get"];

/// Longest script file read from disk; the real ones are a few KiB.
const MAX_SCRIPT_BYTES: u64 = 1 << 20;

/// Versions built into the binary: name and texts in [`SCRIPT_NAMES`] order.
const BUILTIN: [(&str, [&str; 4]); 2] = [
    (
        "v1",
        [
            include_str!("../lua/v1/claim.lua"),
            include_str!("../lua/v1/complete.lua"),
            include_str!("../lua/v1/release.lua"),
            include_str!("../lua/v1/get.lua"),
        ],
    ),
    (
        "v2",
        [
            include_str!("../lua/v2/claim.lua"),
            include_str!("../lua/v2/complete.lua"),
            include_str!("../lua/v2/release.lua"),
            include_str!("../lua/v2/get.lua"),
        ],
    ),
];

/// Where a version's text came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// Compiled into the binary.
    Builtin,
    /// Read from this version directory.
    Dir(PathBuf),
}

/// The text of one version's four scripts.
#[derive(Clone, PartialEq, Eq)]
pub struct Sources {
    /// Version name, e.g. `v2`.
    pub version: String,
    /// Where the text came from.
    pub origin: Origin,
    /// Script texts in [`SCRIPT_NAMES`] order.
    pub texts: [String; 4],
}

/// Why a version's sources could not be had.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The name could not be a directory name of ours.
    #[error("invalid version name {0:?} (1-64 of letters, digits, '.', '_', '-'; not starting with '.')")]
    BadName(String),
    /// Neither the directory nor the binary has the version.
    #[error("unknown script version {version:?} ({})", describe_known(dir.as_deref()))]
    Unknown {
        /// The version asked for.
        version: String,
        /// The configured directory, if any.
        dir: Option<PathBuf>,
    },
    /// The version directory exists but a script in it cannot be read.
    #[error("cannot read {}: {message}", path.display())]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
}

// === impl Sources ===

impl Sources {
    /// Finds `version` in `dir` (if given) and then among the built-in versions.
    pub fn find(dir: Option<&Path>, version: &str) -> Result<Sources, SourceError> {
        check_version_name(version)?;
        if let Some(dir) = dir {
            let version_dir = dir.join(version);
            if version_dir.is_dir() {
                return Sources::read_dir(version, &version_dir);
            }
        }
        Sources::builtin(version).ok_or_else(|| SourceError::Unknown {
            version: version.to_owned(),
            dir: dir.map(Path::to_path_buf),
        })
    }

    /// The built-in version of that name.
    pub fn builtin(version: &str) -> Option<Sources> {
        BUILTIN
            .iter()
            .find(|(name, _)| *name == version)
            .map(Sources::from_builtin)
    }

    /// The built-in `v1`, the default active version.
    pub fn builtin_v1() -> Sources {
        Sources::from_builtin(&BUILTIN[0])
    }

    fn from_builtin((name, texts): &(&str, [&str; 4])) -> Sources {
        Sources {
            version: (*name).to_owned(),
            origin: Origin::Builtin,
            texts: texts.map(str::to_owned),
        }
    }

    fn read_dir(version: &str, version_dir: &Path) -> Result<Sources, SourceError> {
        let read = |name: &str| {
            let path = version_dir.join(format!("{name}.lua"));
            let unreadable = |message: String| SourceError::Unreadable {
                path: path.clone(),
                message,
            };
            // A regular file only: a FIFO would block its open (and every reload and watcher
            // tick after it), a device such as /dev/zero would never end. Read through the cap
            // as well (`read_capped`): a file may grow after its size was read.
            let meta = std::fs::metadata(&path).map_err(|e| unreadable(e.to_string()))?;
            if !meta.is_file() {
                return Err(unreadable("not a regular file".into()));
            }
            let len = meta.len();
            if len > MAX_SCRIPT_BYTES {
                return Err(unreadable(format!(
                    "{len} bytes is more than a script may have ({MAX_SCRIPT_BYTES})"
                )));
            }
            let bytes = crate::config::read_capped(&path, MAX_SCRIPT_BYTES)
                .map_err(|e| unreadable(e.to_string()))?;
            String::from_utf8(bytes).map_err(|e| unreadable(e.to_string()))
        };
        Ok(Sources {
            version: version.to_owned(),
            origin: Origin::Dir(version_dir.to_path_buf()),
            texts: [
                read(SCRIPT_NAMES[0])?,
                read(SCRIPT_NAMES[1])?,
                read(SCRIPT_NAMES[2])?,
                read(SCRIPT_NAMES[3])?,
            ],
        })
    }

    /// The file (or `builtin:<version>/<name>.lua`) a script came from, for messages.
    pub fn describe(&self, script: usize) -> String {
        let name = SCRIPT_NAMES.get(script).copied().unwrap_or("?");
        match &self.origin {
            Origin::Builtin => format!("builtin:{}/{name}.lua", self.version),
            Origin::Dir(dir) => dir.join(format!("{name}.lua")).display().to_string(),
        }
    }
}

impl fmt::Debug for Sources {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sources")
            .field("version", &self.version)
            .field("origin", &self.origin)
            .finish_non_exhaustive()
    }
}

// === impl Origin ===

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Builtin => f.write_str("builtin"),
            Origin::Dir(dir) => write!(f, "{}", dir.display()),
        }
    }
}

// === functions ===

/// Names of the versions compiled into the binary.
pub fn builtin_versions() -> impl Iterator<Item = &'static str> {
    BUILTIN.iter().map(|(name, _)| *name)
}

/// Every version name that [`Sources::find`] could look up: the built-in ones and the
/// subdirectories of `dir` with a valid name, sorted. A listed directory may still be
/// incomplete; `find` says so.
pub fn available(dir: Option<&Path>) -> Vec<String> {
    let mut names: Vec<String> = builtin_versions().map(str::to_owned).collect();
    if let Some(entries) = dir.and_then(|d| std::fs::read_dir(d).ok()) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if check_version_name(&name).is_ok() && entry.path().is_dir() {
                names.push(name);
            }
        }
    }
    names.sort();
    names.dedup();
    names
}

/// A version name is one path component we are willing to join onto the directory.
pub fn check_version_name(name: &str) -> Result<(), SourceError> {
    let ok = (1..=64).contains(&name.len())
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(SourceError::BadName(name.to_owned()))
    }
}

fn describe_known(dir: Option<&Path>) -> String {
    let known = available(dir).join(", ");
    match dir {
        Some(dir) => format!(
            "no directory {} and not built in; known: {known}",
            dir.display()
        ),
        None => format!("not built in and no scripts.dir is set; known: {known}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_version(root: &Path, version: &str, marker: &str) {
        let dir = root.join(version);
        std::fs::create_dir_all(&dir).unwrap();
        for name in SCRIPT_NAMES {
            std::fs::write(
                dir.join(format!("{name}.lua")),
                format!("-- {marker} {name}"),
            )
            .unwrap();
        }
    }

    #[test]
    fn a_script_that_is_no_regular_file_or_too_large_is_refused_without_reading_it() {
        let root = tempfile::tempdir().unwrap();
        write_version(root.path(), "v7", "edited");
        let claim = root.path().join("v7/claim.lua");
        let refused = |why: &str| match Sources::find(Some(root.path()), "v7") {
            Err(SourceError::Unreadable { path, message }) => {
                assert_eq!(path, claim);
                assert!(message.contains(why), "{message}");
            }
            other => panic!("{why}: {other:?}"),
        };
        // A device that never ends, and a FIFO nobody writes to (its open would block).
        std::fs::remove_file(&claim).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &claim).unwrap();
        refused("not a regular file");
        std::fs::remove_file(&claim).unwrap();
        let path = std::ffi::CString::new(claim.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
        refused("not a regular file");
        std::fs::remove_file(&claim).unwrap();
        std::fs::write(&claim, vec![b'-'; MAX_SCRIPT_BYTES as usize + 1]).unwrap();
        refused("more than a script may have");
        std::fs::write(&claim, "-- edited claim").unwrap();
        assert!(Sources::find(Some(root.path()), "v7").is_ok());
    }

    #[test]
    fn builtin_versions_are_distinct_and_open_with_their_contract() {
        let v1 = Sources::find(None, "v1").unwrap();
        let v2 = Sources::find(None, "v2").unwrap();
        assert_eq!(v1.origin, Origin::Builtin);
        assert!(v1 == Sources::builtin_v1());
        for (a, b) in v1.texts.iter().zip(&v2.texts) {
            assert_ne!(a, b, "v2 must differ from v1 script by script");
        }
        for sources in [&v1, &v2] {
            for (i, text) in sources.texts.iter().enumerate() {
                let header: String = text
                    .lines()
                    .take_while(|line| line.starts_with("--") || line.is_empty())
                    .collect::<Vec<_>>()
                    .join("\n");
                assert!(
                    header
                        .starts_with(&format!("-- {}.lua ({})", SCRIPT_NAMES[i], sources.version)),
                    "{header}"
                );
                for part in ["KEYS[1]", "Reply:", "Transition"] {
                    assert!(header.contains(part), "header lacks {part}:\n{header}");
                }
            }
        }
    }

    #[test]
    fn a_directory_overrides_and_adds_versions() {
        let root = tempfile::tempdir().unwrap();
        write_version(root.path(), "v1", "disk");
        write_version(root.path(), "v3", "new");
        let v1 = Sources::find(Some(root.path()), "v1").unwrap();
        assert_eq!(v1.texts[0], "-- disk claim");
        assert_eq!(v1.origin, Origin::Dir(root.path().join("v1")));
        assert_eq!(
            v1.describe(3),
            root.path().join("v1/get.lua").display().to_string()
        );
        // Not on disk: the built-in one.
        let v2 = Sources::find(Some(root.path()), "v2").unwrap();
        assert_eq!(v2.origin, Origin::Builtin);
        assert_eq!(v2.describe(0), "builtin:v2/claim.lua");
        assert_eq!(
            Sources::find(Some(root.path()), "v3").unwrap().texts[2],
            "-- new release"
        );
        assert_eq!(available(Some(root.path())), ["v1", "v2", "v3"]);
        assert_eq!(available(None), ["v1", "v2"]);
    }

    #[test]
    fn missing_versions_files_and_bad_names_are_errors() {
        let root = tempfile::tempdir().unwrap();
        write_version(root.path(), "v4", "partial");
        std::fs::remove_file(root.path().join("v4/get.lua")).unwrap();
        // A half-present version is an error, never half built in.
        let err = Sources::find(Some(root.path()), "v4")
            .unwrap_err()
            .to_string();
        assert!(err.contains("v4/get.lua"), "{err}");
        let err = Sources::find(Some(root.path()), "v9")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"v9\"") && err.contains("known: v1, v2, v4"),
            "{err}"
        );
        let err = Sources::find(None, "v9").unwrap_err().to_string();
        assert!(err.contains("no scripts.dir"), "{err}");
        for bad in ["", "..", ".hidden", "a/b", "v 1", &"x".repeat(65)] {
            assert!(
                matches!(
                    Sources::find(Some(root.path()), bad),
                    Err(SourceError::BadName(_))
                ),
                "{bad:?}"
            );
        }
    }
}
