//! Child processes with a log file, killed on drop; `/proc` helpers for their children.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// A child process whose output goes to a log file; killed on drop, log printed if the test
/// is failing.
pub struct Proc {
    pub name: String,
    child: Option<Child>,
    pub log: PathBuf,
    /// Just before the process was spawned (start-up benchmarks measure from here).
    pub started: tokio::time::Instant,
}

impl Proc {
    pub fn spawn(name: &str, mut cmd: Command, log_dir: &Path) -> Proc {
        let log = log_dir.join(format!("{name}.log"));
        let out = File::create(&log).expect("create log file");
        let err = out.try_clone().expect("clone log file");
        cmd.stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err));
        // Its own process group, so killing it also kills what it started (the agent's Envoy):
        // a SIGKILLed agent cannot stop its children itself.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let started = tokio::time::Instant::now();
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {name} ({:?}): {e}", cmd.get_program()));
        Proc {
            name: name.to_owned(),
            child: Some(child),
            log,
            started,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, |c| c.id())
    }

    /// Exit status if the process has ended.
    pub fn try_wait(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// SIGKILL to the whole process group (the process and everything it started).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            if let Ok(pgid) = i32::try_from(c.id()) {
                let _ = nix::sys::signal::killpg(
                    nix::unistd::Pid::from_raw(pgid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn print_log(&self) {
        eprintln!(
            "===== log of {} ({}) =====\n{}\n===== end of {} =====",
            self.name,
            self.log.display(),
            self.log_text(),
            self.name
        );
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            self.print_log();
        }
    }
}

/// The parent pid and state letter of `pid` from `/proc/<pid>/stat` (the fields after the
/// parenthesised command name, which may itself hold spaces and parentheses).
fn stat_of(pid: u32) -> Option<(u32, char)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = s.rsplit_once(") ")?;
    let mut f = rest.split_whitespace();
    let state = f.next()?.chars().next()?;
    Some((f.next()?.parse().ok()?, state))
}

/// Every live process whose parent is `pid`. (Not `/proc/<pid>/task/<pid>/children`, which
/// lists only the main thread's children: Go starts Envoy from whichever thread runs the
/// goroutine.)
pub fn children_of(pid: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .expect("read /proc")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&p| matches!(stat_of(p), Some((pp, st)) if pp == pid && st != 'Z'))
        .collect()
}

/// The children of `pid` that run Envoy (`/proc/<p>/comm` is `envoy`). An agent may have
/// other short-lived children: the Go runtime of pilot-agent forks one while it starts.
pub fn envoy_children_of(pid: u32) -> Vec<u32> {
    children_of(pid)
        .into_iter()
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == "envoy")
        })
        .collect()
}

/// Whether `pid` runs; a zombie (exited, not yet reaped) counts as gone.
pub fn alive(pid: u32) -> bool {
    matches!(stat_of(pid), Some((_, st)) if st != 'Z')
}

/// Sends signal `sig` (as `kill(1)` names it: `-TERM`, `-KILL`, `-STOP`...) to `pid`; panics
/// naming both when it cannot be sent.
pub fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill {sig} {pid}");
}
