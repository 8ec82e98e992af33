//! Another process's TCP connections, seen from outside: the established ones it holds to a
//! port (`/proc/<pid>/net/tcp*`, matched to its descriptors by inode), and their options, read on
//! a duplicate of its descriptor (`pidfd_getfd`, Linux 5.6; needs the right to ptrace the
//! process: the same user, or root). Tests use it to check what a binary sets on its sockets,
//! where the library that opens them has its own defaults.

use std::collections::HashSet;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use nix::libc;
use nix::sys::socket::{getsockopt, sockopt};

/// The options of one TCP connection that matter to a long-lived client connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct TcpOptions {
    /// `TCP_NODELAY`: Nagle's algorithm off.
    pub nodelay: bool,
    /// `SO_KEEPALIVE`, with `TCP_KEEPIDLE`, `TCP_KEEPINTVL` (seconds) and `TCP_KEEPCNT` when on.
    pub keepalive: Option<(u32, u32, u32)>,
}

/// The options of every established TCP connection that process `pid` holds to `remote_port`
/// (on any address), in no particular order. Panics when `/proc` or the duplication fails.
pub fn tcp_options_to(pid: u32, remote_port: u16) -> Vec<TcpOptions> {
    let inodes = established_to(pid, remote_port);
    if inodes.is_empty() {
        return Vec::new();
    }
    // SAFETY: plain system calls on integers; each returns a new descriptor or -1.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::c_long, 0) };
    assert!(
        pidfd >= 0,
        "pidfd_open({pid}): {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: pidfd_open returned a descriptor this process now owns.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as i32) };
    let dir = format!("/proc/{pid}/fd");
    let mut found = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("read {dir}: {e}")) {
        let Ok(entry) = entry else { continue };
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        let target = target.to_string_lossy();
        let Some(inode) = target
            .strip_prefix("socket:[")
            .and_then(|s| s.strip_suffix(']'))
        else {
            continue;
        };
        if !inodes.contains(inode) {
            continue;
        }
        let Ok(fd) = entry.file_name().to_string_lossy().parse::<libc::c_long>() else {
            continue;
        };
        // SAFETY: as above; the duplicate is a new descriptor of this process.
        let dup = unsafe {
            libc::syscall(
                libc::SYS_pidfd_getfd,
                pidfd.as_raw_fd() as libc::c_long,
                fd,
                0,
            )
        };
        if dup < 0 {
            // The connection closed since /proc was read.
            continue;
        }
        // SAFETY: pidfd_getfd returned a descriptor this process now owns, of a TCP socket.
        let socket = unsafe { OwnedFd::from_raw_fd(dup as i32) };
        let read = |what: &str, e: nix::Error| -> ! { panic!("{what} of fd {fd} of {pid}: {e}") };
        let nodelay =
            getsockopt(&socket, sockopt::TcpNoDelay).unwrap_or_else(|e| read("TCP_NODELAY", e));
        let on =
            getsockopt(&socket, sockopt::KeepAlive).unwrap_or_else(|e| read("SO_KEEPALIVE", e));
        let keepalive = on.then(|| {
            (
                getsockopt(&socket, sockopt::TcpKeepIdle)
                    .unwrap_or_else(|e| read("TCP_KEEPIDLE", e)),
                getsockopt(&socket, sockopt::TcpKeepInterval)
                    .unwrap_or_else(|e| read("TCP_KEEPINTVL", e)),
                getsockopt(&socket, sockopt::TcpKeepCount)
                    .unwrap_or_else(|e| read("TCP_KEEPCNT", e)),
            )
        });
        found.push(TcpOptions { nodelay, keepalive });
    }
    found
}

/// The socket inodes of the established TCP connections of `pid`'s network namespace to
/// `remote_port`.
fn established_to(pid: u32, remote_port: u16) -> HashSet<String> {
    let mut inodes = HashSet::new();
    for table in ["tcp", "tcp6"] {
        let path = format!("/proc/{pid}/net/{table}");
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            if f.len() < 10 || f[3] != "01" {
                continue;
            }
            let port = f[2]
                .rsplit(':')
                .next()
                .and_then(|p| u16::from_str_radix(p, 16).ok());
            if port == Some(remote_port) {
                inodes.insert(f[9].to_string());
            }
        }
    }
    inodes
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::process::{Command, Stdio};

    #[test]
    fn reads_the_options_of_another_process_s_connections() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        // A child holding two connections to the listener: one as opened (Nagle on, no
        // keepalive), one with TCP_NODELAY and keepalive probes after 45 s, every 7 s, 4 of them.
        let mut child = Command::new("python3")
            .args([
                "-c",
                &format!(
                    "import socket,sys\n\
                     a=socket.create_connection(('127.0.0.1',{port}))\n\
                     b=socket.create_connection(('127.0.0.1',{port}))\n\
                     b.setsockopt(socket.IPPROTO_TCP,socket.TCP_NODELAY,1)\n\
                     b.setsockopt(socket.SOL_SOCKET,socket.SO_KEEPALIVE,1)\n\
                     b.setsockopt(socket.IPPROTO_TCP,socket.TCP_KEEPIDLE,45)\n\
                     b.setsockopt(socket.IPPROTO_TCP,socket.TCP_KEEPINTVL,7)\n\
                     b.setsockopt(socket.IPPROTO_TCP,socket.TCP_KEEPCNT,4)\n\
                     print('up',flush=True)\n\
                     sys.stdin.read()"
                ),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3");
        let _a = listener.accept().unwrap();
        let _b = listener.accept().unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        let mut got = tcp_options_to(child.id(), port);
        got.sort();
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(
            got,
            vec![
                TcpOptions {
                    nodelay: false,
                    keepalive: None
                },
                TcpOptions {
                    nodelay: true,
                    keepalive: Some((45, 7, 4))
                },
            ]
        );
    }
}
