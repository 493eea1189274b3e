//! CPU time and memory of a process tree from /proc: nanoseconds on CPU summed over every thread
//! (`/proc/PID/task/TID/schedstat`, exact where `stat`'s ticks are 10 ms), and resident memory.

use std::collections::HashMap;
use std::fs;

/// `pid` and every process below it.
pub fn tree(pid: u32) -> Vec<u32> {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    if let Ok(dir) = fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Some(p) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
            let Ok(stat) = fs::read_to_string(format!("/proc/{p}/stat")) else { continue };
            // The command name is in parentheses and may hold spaces: parse after the last ')'.
            let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else { continue };
            if let Some(ppid) = rest.split_whitespace().nth(1).and_then(|s| s.parse::<u32>().ok()) {
                children.entry(ppid).or_default().push(p);
            }
        }
    }
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() {
        if let Some(c) = children.get(&out[i]) {
            out.extend(c);
        }
        i += 1;
    }
    out
}

/// Nanoseconds on CPU of every thread of the tree under `pid`.
pub fn cpu_ns(pid: u32) -> u64 {
    let mut total = 0;
    for p in tree(pid) {
        let Ok(tasks) = fs::read_dir(format!("/proc/{p}/task")) else { continue };
        for t in tasks.flatten() {
            if let Ok(s) = fs::read_to_string(t.path().join("schedstat")) {
                total += s.split_whitespace().next().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            }
        }
    }
    total
}

/// Resident set size of the tree under `pid`, in bytes.
pub fn rss_bytes(pid: u32) -> u64 {
    tree(pid).into_iter().map(|p| status_kb(p, "VmRSS:")).sum()
}

/// A field of `/proc/PID/status` that is given in kB (`VmRSS:`, `VmHWM:`), in bytes.
fn status_kb(pid: u32, field: &str) -> u64 {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .unwrap_or(0)
        * 1024
}

/// The peak resident set of `pid` since it started, in bytes.
pub fn peak_rss_bytes(pid: u32) -> u64 {
    status_kb(pid, "VmHWM:")
}

/// File descriptors `pid` has open.
pub fn open_fds(pid: u32) -> usize {
    fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0)
}

/// Threads of `pid`.
pub fn threads(pid: u32) -> usize {
    fs::read_dir(format!("/proc/{pid}/task")).map(|d| d.count()).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    #[test]
    fn own_process_is_measured() {
        let me = std::process::id();
        // This thread's own time: the process's sum may drop meanwhile, when another test's
        // thread ends and takes its time out of /proc/PID/task.
        let mine = || {
            std::fs::read_to_string("/proc/thread-self/schedstat")
                .ok()
                .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse::<u64>().ok()))
                .unwrap_or(0)
        };
        let before = mine();
        let mut x = 0u64;
        for i in 0..5_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        let after = mine();
        assert!(after > before);
        assert!(super::cpu_ns(me) >= after, "the process's time holds this thread's");
        assert!(super::rss_bytes(me) > 1 << 20);
        assert_eq!(super::tree(me)[0], me);
        assert!(super::peak_rss_bytes(me) >= super::rss_bytes(me));
        assert!(super::open_fds(me) >= 3 && super::threads(me) >= 1);
    }
}
