//! A frontend thread's plug, as the kernel's block layer has one per task: while a thread that
//! serves requests is plugged, a [`BlockDevice`](crate::BlockDevice) may hold back what its
//! `submit_*` calls would send (to a replica over the network, say) and send it all at once when
//! the thread calls [`BlockDevice::unplug`](crate::BlockDevice::unplug). A frontend plugs while
//! it takes a burst of requests that are already queued, and unplugs before it waits for more,
//! so a burst of 4 KiB writes costs one send per replica instead of one per write, and a lone
//! request waits for nothing but one more look at the queue.
//!
//! The plug belongs to the thread, not to a call: a device's own threads (its runtime, the
//! threads completing replies) are never plugged, so nothing they do is held back, and a thread
//! that blocks on the device (`write_at`, `flush`) must not count on a held-back send: the
//! device sends everything before it makes a plugged thread wait (see
//! `ReplicatedVolume`'s driver).

use std::cell::Cell;

thread_local! {
    static PLUGGED: Cell<bool> = const { Cell::new(false) };
}

/// Whether the calling thread is plugged: a device may hold back what it sends until the
/// thread calls `unplug`.
pub fn is_plugged() -> bool {
    PLUGGED.with(Cell::get)
}

/// Plugs the calling thread until dropped. The holder must call the device's `unplug` after
/// dropping it and before it waits for anything.
#[must_use = "the thread is plugged only while the guard lives"]
pub struct Plug {
    /// Whether the thread was plugged already (nested plugs keep the outer one's state).
    was: bool,
    /// A plug is the thread's own: not `Send`.
    _thread: std::marker::PhantomData<*const ()>,
}

impl Plug {
    pub fn new() -> Self {
        Self { was: PLUGGED.with(|p| p.replace(true)), _thread: std::marker::PhantomData }
    }
}

impl Default for Plug {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for Plug {
    fn drop(&mut self) {
        PLUGGED.with(|p| p.set(self.was));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plug_holds_for_its_thread_and_its_lifetime_only() {
        assert!(!is_plugged());
        {
            let _outer = Plug::new();
            assert!(is_plugged());
            {
                let _inner = Plug::new();
                assert!(is_plugged());
            }
            // The inner plug's end leaves the outer one in place.
            assert!(is_plugged());
            let other = std::thread::spawn(is_plugged).join().unwrap_or(true);
            assert!(!other, "another thread is not plugged by this one's plug");
        }
        assert!(!is_plugged());
    }
}
