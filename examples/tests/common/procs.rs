//! Servers and clients as child processes, killed when the test ends.

use super::LIMIT;
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A child process, killed when dropped (so a failing test leaves none behind).
pub struct Proc {
    pub child: Child,
    stderr: Arc<Mutex<String>>,
    stderr_reader: Option<JoinHandle<()>>,
}

impl Proc {
    pub fn spawn(command: &mut Command) -> Proc {
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .env("RUST_LOG", "warn")
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {command:?}: {e}"));
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut pipe = child.stderr.take().unwrap();
        let sink = stderr.clone();
        let reader = std::thread::spawn(move || {
            let mut buf = [0; 4096];
            while let Ok(n @ 1..) = pipe.read(&mut buf) {
                sink.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        Proc {
            child,
            stderr,
            stderr_reader: Some(reader),
        }
    }

    /// What the process wrote to stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// Everything the process wrote to stderr, once it has exited.
    pub fn all_stderr(&mut self) -> String {
        if let Some(reader) = self.stderr_reader.take() {
            let _ = reader.join();
        }
        self.stderr()
    }

    /// Sends a signal by name (`STOP`, `KILL`...).
    pub fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.child.id().to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{name} failed");
        if name == "STOP" {
            self.wait_stopped();
        }
    }

    /// Waits until every thread of the process has stopped: `kill -STOP`
    /// returns when the signal is sent, and a thread running on another core
    /// stops only when it next enters the kernel.
    fn wait_stopped(&self) {
        let tasks = format!("/proc/{}/task", self.child.id());
        let deadline = Instant::now() + LIMIT;
        loop {
            let stopped = std::fs::read_dir(&tasks)
                .expect("list the process's threads")
                .filter_map(Result::ok)
                .all(|task| {
                    // The state follows the command name's closing parenthesis.
                    std::fs::read_to_string(task.path().join("stat"))
                        .ok()
                        .and_then(|stat| {
                            let rest = &stat[stat.rfind(')')? + 1..];
                            let state = rest.split_whitespace().next()?;
                            // Stopped, or dead (a zombie runs no more).
                            Some(matches!(state, "T" | "t" | "Z" | "X"))
                        })
                        // A thread that exited meanwhile does not run.
                        .unwrap_or(true)
                });
            if stopped {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the process did not stop within {LIMIT:?}"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Kills the process and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits for the process to exit, up to [`LIMIT`]; kills it after that.
    pub fn wait(&mut self) -> ExitStatus {
        let deadline = Instant::now() + LIMIT;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            if Instant::now() >= deadline {
                self.kill();
                panic!(
                    "process did not exit within {LIMIT:?}; stderr:\n{}",
                    self.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A server binary of this package (`kv-server`, `route-guide-server`)
/// as a child process.
pub struct ServerProc {
    pub proc: Proc,
    pub url: String,
    /// The lines it printed after the first.
    pub lines: mpsc::Receiver<String>,
}

impl ServerProc {
    /// Starts `kv-server --listen listen` and waits for it to say where it listens.
    pub fn kv(listen: &str) -> ServerProc {
        ServerProc::start(env!("CARGO_BIN_EXE_kv-server"), listen)
    }

    /// Starts `route-guide-server --listen listen`, as [`ServerProc::kv`].
    pub fn route_guide(listen: &str) -> ServerProc {
        ServerProc::start(env!("CARGO_BIN_EXE_route-guide-server"), listen)
    }

    /// Starts `bin --listen listen` and waits for it to say where it listens.
    fn start(bin: &str, listen: &str) -> ServerProc {
        ServerProc::start_with(bin, &["--listen", listen])
    }

    /// Starts `bin args...` (which must say `--listen`) and waits for it to
    /// say where it listens.
    pub fn start_with(bin: &str, args: &[&str]) -> ServerProc {
        let name = std::path::Path::new(bin)
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let mut proc = Proc::spawn(Command::new(bin).args(args));
        let stdout = proc.child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let line = rx
            .recv_timeout(LIMIT)
            .unwrap_or_else(|_| panic!("{name} printed no address; stderr:\n{}", proc.stderr()));
        let url = line
            .strip_prefix(&format!("{name} listening on "))
            .unwrap_or_else(|| panic!("unexpected first line from {name}: {line:?}"))
            .to_owned();
        assert!(!url.ends_with(":0"), "{name} reported no real port: {url}");
        ServerProc {
            proc,
            url,
            lines: rx,
        }
    }
}
