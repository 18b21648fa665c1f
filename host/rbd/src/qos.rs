//! QoS limits of one image as librbd enforces them: the `rbd_qos_*_limit` options in the image's
//! own configuration, which librbd keeps as image metadata under a `conf_` prefix — the keys
//! ceph-csi sets (and `rbd config image set` writes). Reads and writes apart, operations and
//! bytes per second; librbd's combined `rbd_qos_iops_limit` / `rbd_qos_bps_limit` and the burst
//! options are left alone. Only librbd clients honour them (rbd-nbd, rbd-fuse, QEMU), not krbd.

/// An image's limits; 0 = no limit of the image's own (its key is removed: the pool's or the
/// cluster's setting applies, unlimited by default).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QosLimits {
    pub read_iops: u64,
    pub write_iops: u64,
    pub read_bytes_per_second: u64,
    pub write_bytes_per_second: u64,
}

/// The image metadata key of each limit, in [`QosLimits::keys`] order.
pub const QOS_KEYS: [&str; 4] = [
    "conf_rbd_qos_read_iops_limit",
    "conf_rbd_qos_write_iops_limit",
    "conf_rbd_qos_read_bps_limit",
    "conf_rbd_qos_write_bps_limit",
];

impl QosLimits {
    /// Each limit with its metadata key.
    pub fn keys(&self) -> [(&'static str, u64); 4] {
        let values = [self.read_iops, self.write_iops, self.read_bytes_per_second, self.write_bytes_per_second];
        [(QOS_KEYS[0], values[0]), (QOS_KEYS[1], values[1]), (QOS_KEYS[2], values[2]), (QOS_KEYS[3], values[3])]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_limit_has_the_key_ceph_csi_sets() {
        let l = QosLimits { read_iops: 1, write_iops: 2, read_bytes_per_second: 3, write_bytes_per_second: 4 };
        assert_eq!(
            l.keys(),
            [
                ("conf_rbd_qos_read_iops_limit", 1),
                ("conf_rbd_qos_write_iops_limit", 2),
                ("conf_rbd_qos_read_bps_limit", 3),
                ("conf_rbd_qos_write_bps_limit", 4),
            ]
        );
    }
}
