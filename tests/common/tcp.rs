//! The kernel's table of IPv4 TCP sockets (`/proc/net/tcp`), for tests that look at a
//! connection from outside the process holding it.

/// `/proc/net/tcp`'s code for ESTABLISHED.
pub const ESTABLISHED: u8 = 0x01;

/// One row of `/proc/net/tcp`: `sl local rem st tx_queue:rx_queue tr:tm->when retrnsmt uid
/// timeout inode ...`, addresses as `HEXIP:HEXPORT`.
#[derive(Clone, Debug)]
pub struct TcpSocket {
    pub local_port: u16,
    pub remote_port: u16,
    pub state: u8,
    /// Bytes sent but not acknowledged, or not sent yet.
    pub tx_queue: u64,
    /// The active timer: 0 none, 1 retransmit, 2 keepalive, 3 TIME_WAIT, 4 zero-window probe.
    pub timer: u8,
    pub inode: u64,
}

/// Every row of `/proc/net/tcp` (empty when it cannot be read).
pub fn sockets() -> Vec<TcpSocket> {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    table.lines().skip(1).filter_map(parse_row).collect()
}

fn parse_row(row: &str) -> Option<TcpSocket> {
    let cols: Vec<&str> = row.split_whitespace().collect();
    let port = |addr: &str| u16::from_str_radix(addr.rsplit(':').next()?, 16).ok();
    let hex_before_colon = |col: &str| u64::from_str_radix(col.split(':').next()?, 16).ok();
    Some(TcpSocket {
        local_port: port(cols.get(1)?)?,
        remote_port: port(cols.get(2)?)?,
        state: u8::from_str_radix(cols.get(3)?, 16).ok()?,
        tx_queue: hex_before_colon(cols.get(4)?)?,
        timer: u8::try_from(hex_before_colon(cols.get(5)?)?).ok()?,
        inode: cols.get(9)?.parse().ok()?,
    })
}

/// The socket with these local and remote ports, if the kernel still has one.
pub fn socket(local_port: u16, remote_port: u16) -> Option<TcpSocket> {
    sockets()
        .into_iter()
        .find(|s| s.local_port == local_port && s.remote_port == remote_port)
}

/// The socket inodes process `pid` holds open.
pub fn inodes_of(pid: u32) -> Vec<u64> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|dir| {
            dir.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .filter_map(|target| {
                    let t = target.to_string_lossy().into_owned();
                    t.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
                })
                .collect()
        })
        .unwrap_or_default()
}
