//! A fault to inject for tests (feature `testing`): makes server
//! dispatchers panic on a chosen method, to test what contains a bug of
//! ours.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// Set once any fault is armed: the common case reads this alone.
static ARMED: AtomicBool = AtomicBool::new(false);
/// The method ids whose frames make a dispatcher panic.
static PANIC_ON: Mutex<Vec<u32>> = Mutex::new(Vec::new());

/// Makes every server dispatcher of the process panic, as a bug of
/// ours would, while it handles a frame for `method_id`, in the middle
/// of the completion that brought it. For good: pick an id no other
/// test calls.
pub fn panic_on_method(method_id: u32) {
    PANIC_ON
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(method_id);
    ARMED.store(true, Ordering::Release);
}

pub(super) fn check(method_id: u32) {
    if ARMED.load(Ordering::Acquire)
        && PANIC_ON
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&method_id)
    {
        panic!("fault injected for method id {method_id:#x}");
    }
}
