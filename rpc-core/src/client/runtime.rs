//! The client runtimes: the dispatchers that serve every channel of the
//! process, one set per fabric context.

use super::role::ClientRole;
use crate::Status;
use crate::dispatch::{Config, Endpoint};
use crate::fabric::Fabric;
#[cfg(feature = "verbs")]
use crate::fabric::FabricUrl;
use crate::fabric::soft::SoftFabric;
use std::sync::{Arc, Mutex, OnceLock};

/// The dispatchers that serve every channel of the process on one fabric
/// context. They live as long as the process; idle, they block.
pub(super) struct ClientRuntime<F: Fabric> {
    pub(super) endpoints: Vec<Arc<Endpoint<F, ClientRole>>>,
}

impl<F: Fabric> ClientRuntime<F> {
    fn start(fabric: F, name: &str) -> Result<ClientRuntime<F>, Status> {
        let n = crate::dispatch::available_cores();
        let mut endpoints = Vec::with_capacity(n);
        for i in 0..n {
            let ep = Endpoint::new(
                fabric.clone(),
                Config::default(),
                ClientRole::default(),
                false,
            )?;
            let runner = ep.clone();
            std::thread::Builder::new()
                .name(format!("rpc-client-{name}-{i}"))
                .spawn(move || runner.run())
                .map_err(|e| Status::internal(format!("cannot spawn a client dispatcher: {e}")))?;
            endpoints.push(ep);
        }
        Ok(ClientRuntime { endpoints })
    }
}

/// The client runtime of the software fabric (mem:// and tcp://).
pub(super) fn soft_runtime() -> Result<&'static ClientRuntime<SoftFabric>, Status> {
    static RT: OnceLock<ClientRuntime<SoftFabric>> = OnceLock::new();
    static START: Mutex<()> = Mutex::new(());
    if let Some(rt) = RT.get() {
        return Ok(rt);
    }
    let _one = START.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(rt) = RT.get() {
        return Ok(rt);
    }
    let rt = ClientRuntime::start(SoftFabric::new(), "soft")?;
    Ok(RT.get_or_init(|| rt))
}

/// The client runtime of the RDMA device `url` selects (one per device,
/// port and GID choice).
#[cfg(feature = "verbs")]
pub(super) fn verbs_runtime(
    url: &FabricUrl,
) -> Result<Arc<ClientRuntime<crate::fabric::verbs::VerbsFabric>>, Status> {
    use crate::fabric::verbs::DeviceSelection;
    type Runtimes = Mutex<
        Vec<(
            DeviceSelection,
            Arc<ClientRuntime<crate::fabric::verbs::VerbsFabric>>,
        )>,
    >;
    static RTS: OnceLock<Runtimes> = OnceLock::new();
    // URLs that select alike share a runtime, without opening the device
    // again.
    let key = DeviceSelection::of(url);
    let mut rts = RTS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some((_, rt)) = rts.iter().find(|(k, _)| *k == key) {
        return Ok(rt.clone());
    }
    let fabric = crate::fabric::open_verbs(url)?;
    let device = fabric.choice().device.clone();
    let rt = Arc::new(ClientRuntime::start(fabric, &device)?);
    rts.push((key, rt.clone()));
    Ok(rt)
}
