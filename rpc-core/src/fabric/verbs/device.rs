//! Which device, port and GID a context uses.

use super::*;

/// Where the chosen device, port and GID came from.
#[derive(Debug, Clone)]
pub struct DeviceChoice {
    /// Device name (`mlx5_0`, `rxe0`).
    pub device: String,
    /// Port number (from 1).
    pub port: u8,
    /// GID index used for RoCE (and IB with a GRH).
    pub gid_index: u8,
    /// The GID.
    pub gid: [u8; 16],
    /// The port's LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Whether the link layer is Ethernet (RoCE): addressing by GID.
    pub ethernet: bool,
    /// Active MTU (`ibv_mtu` value).
    pub(super) mtu: ffi::ibv_mtu,
}

pub(super) fn no_device(why: impl Into<String>) -> FabricError {
    FabricError {
        op: "rdma",
        kind: FabricErrorKind::NoDevice(why.into()),
    }
}

/// The GID's type as the kernel names it ("IB/RoCE v1", "RoCE v2").
pub(super) fn gid_type(device: &str, port: u8, index: u8) -> Option<String> {
    let path = format!("/sys/class/infiniband/{device}/ports/{port}/gid_attrs/types/{index}");
    std::fs::read_to_string(path)
        .ok()
        .map(|t| t.trim().to_owned())
}

pub(super) fn is_ipv4_mapped(gid: &[u8; 16]) -> bool {
    gid[..10].iter().all(|&b| b == 0) && gid[10] == 0xff && gid[11] == 0xff
}

/// What a URL asks of the device choice, unparsed: its `device=`, `port=`
/// and `gid=` parameters, else `RDMA_DEVICE`, `RDMA_PORT` and
/// `RDMA_GID_INDEX`. URLs with equal selections open the same device, port
/// and GID.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DeviceSelection {
    pub device: Option<String>,
    pub port: Option<String>,
    pub gid: Option<String>,
}

impl DeviceSelection {
    pub(crate) fn of(url: &FabricUrl) -> DeviceSelection {
        let param = |k: &str, env: &str| {
            url.param(k)
                .map(str::to_owned)
                .or_else(|| std::env::var(env).ok())
        };
        DeviceSelection {
            device: param("device", "RDMA_DEVICE"),
            port: param("port", "RDMA_PORT"),
            gid: param("gid", "RDMA_GID_INDEX"),
        }
    }
}

/// Finds the device, port and GID to use: `device=`/`port=`/`gid=` URL
/// parameters, else `RDMA_DEVICE`/`RDMA_PORT`/`RDMA_GID_INDEX`, else the first
/// active port of the first device that has one, and its first IPv4-mapped
/// GID (RoCE v2), else its first non-zero GID.
pub(super) fn choose(url: &FabricUrl) -> Result<(Context, DeviceChoice), FabricError> {
    let DeviceSelection {
        device: want_device,
        port,
        gid,
    } = DeviceSelection::of(url);
    let want_port = match port {
        Some(p) => Some(p.parse::<u8>().map_err(|_| {
            FabricError::invalid("rdma", format!("port {p:?} is not a port number"))
        })?),
        None => None,
    };
    let want_gid = match gid {
        Some(g) => Some(g.parse::<u8>().map_err(|_| {
            FabricError::invalid("rdma", format!("gid index {g:?} is not a number"))
        })?),
        None => None,
    };
    let mut n = 0i32;
    // SAFETY: `n` is a valid out-pointer; the list is freed below.
    let list = unsafe { ffi::ibv_get_device_list(&mut n) };
    if list.is_null() {
        let e = std::io::Error::last_os_error();
        return Err(no_device(format!(
            "no RDMA device was found (ibv_get_device_list: {e})"
        )));
    }
    struct List(*mut *mut ffi::ibv_device);
    impl Drop for List {
        fn drop(&mut self) {
            // SAFETY: the list came from ibv_get_device_list; opened contexts stay valid after it is freed.
            unsafe { ffi::ibv_free_device_list(self.0) };
        }
    }
    let list = List(list);
    // SAFETY: the list holds `n` valid device pointers.
    let devices: Vec<*mut ffi::ibv_device> = (0..n.max(0) as usize)
        .map(|i| unsafe { *list.0.add(i) })
        .collect();
    if devices.is_empty() {
        return Err(no_device("no RDMA device was found"));
    }
    let mut seen = Vec::new();
    for dev in devices {
        // SAFETY: `dev` is a live entry of the list.
        let ctx = unsafe { Context::open(dev) }?;
        seen.push(ctx.name.clone());
        if want_device.as_ref().is_some_and(|w| *w != ctx.name) {
            continue;
        }
        let attr = ctx.query_device()?;
        for port in 1..=attr.phys_port_cnt {
            if want_port.is_some_and(|p| p != port) {
                continue;
            }
            let pattr = ctx.query_port(port)?;
            if pattr.state != ffi::ibv_port_state::IBV_PORT_ACTIVE {
                continue;
            }
            let ethernet = pattr.link_layer == ffi::IBV_LINK_LAYER_ETHERNET as u8;
            let gid_index = match want_gid {
                Some(g) => g,
                None => {
                    let gids: Vec<(u8, [u8; 16])> = (0..pattr.gid_tbl_len.clamp(0, 256))
                        .filter_map(|i| ctx.query_gid(port, i).ok().map(|g| (i as u8, g)))
                        .filter(|(_, g)| g.iter().any(|&b| b != 0))
                        .collect();
                    // RoCE v2 first (routable), IPv4-mapped first among those.
                    let v2 = |i: u8| {
                        ethernet
                            && gid_type(&ctx.name, port, i)
                                .is_some_and(|t| t.eq_ignore_ascii_case("RoCE v2"))
                    };
                    let pick = gids
                        .iter()
                        .find(|(i, g)| v2(*i) && is_ipv4_mapped(g))
                        .or_else(|| gids.iter().find(|(i, _)| v2(*i)))
                        .or_else(|| gids.iter().find(|(_, g)| ethernet && is_ipv4_mapped(g)))
                        .or(gids.first());
                    match pick {
                        Some((i, _)) => *i,
                        None if !ethernet => 0,
                        None => continue,
                    }
                }
            };
            let gid = ctx.query_gid(port, gid_index as i32)?;
            let choice = DeviceChoice {
                device: ctx.name.clone(),
                port,
                gid_index,
                gid,
                lid: pattr.lid,
                ethernet,
                mtu: pattr.active_mtu,
            };
            return Ok((ctx, choice));
        }
    }
    Err(match want_device {
        Some(w) if !seen.contains(&w) => no_device(format!(
            "RDMA device {w:?} not found (devices: {})",
            seen.join(", ")
        )),
        _ => no_device(format!(
            "no active RDMA port found (devices: {})",
            seen.join(", ")
        )),
    })
}
