//! CSI Identity: who we are, what we offer, and whether we are ready.
use crate::plugin::Plugin;
use std::sync::Arc;
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_proto::csi::v1::identity_server::Identity;
use wasmcsi_proto::csi::v1::plugin_capability::{self, service, volume_expansion};

#[derive(Clone)]
pub struct IdentityService(pub Arc<Plugin>);

#[tonic::async_trait]
impl Identity for IdentityService {
    #[tracing::instrument(name = "csi.get_plugin_info", skip_all)]
    async fn get_plugin_info(
        &self,
        _: tonic::Request<csi::GetPluginInfoRequest>,
    ) -> Result<tonic::Response<csi::GetPluginInfoResponse>, tonic::Status> {
        let d = &self.0;
        let backends = d
            .registry
            .all()
            .iter()
            .map(|b| format!("{}@{}", b.name, &b.digest[..12.min(b.digest.len())]))
            .collect::<Vec<_>>()
            .join(",");
        d.observe("GetPluginInfo", async {
            Ok(csi::GetPluginInfoResponse {
                name: d.name.clone(),
                vendor_version: d.version.clone(),
                // The node a node plugin serves: how a controller finds node plugins by name.
                manifest: [("backends".to_string(), backends)]
                    .into_iter()
                    .chain(d.mode.node().then(|| (crate::peer::NODE_MANIFEST_KEY.to_string(), d.node_id.clone())))
                    .collect(),
            })
        })
        .await
    }

    #[tracing::instrument(name = "csi.get_plugin_capabilities", skip_all)]
    async fn get_plugin_capabilities(
        &self,
        _: tonic::Request<csi::GetPluginCapabilitiesRequest>,
    ) -> Result<tonic::Response<csi::GetPluginCapabilitiesResponse>, tonic::Status> {
        let service = |t: service::Type| csi::PluginCapability {
            r#type: Some(plugin_capability::Type::Service(plugin_capability::Service { r#type: t as i32 })),
        };
        let mut capabilities = vec![service(service::Type::VolumeAccessibilityConstraints)];
        if self.0.mode.controller() {
            capabilities.push(service(service::Type::ControllerService));
            capabilities.push(csi::PluginCapability {
                r#type: Some(plugin_capability::Type::VolumeExpansion(plugin_capability::VolumeExpansion {
                    r#type: volume_expansion::Type::Online as i32,
                })),
            });
            if crate::group_controller::offered(&self.0) {
                capabilities.push(service(service::Type::GroupControllerService));
            }
        }
        self.0.observe("GetPluginCapabilities", async { Ok(csi::GetPluginCapabilitiesResponse { capabilities }) }).await
    }

    /// Ready once the backends directory was scanned and at least one backend serves.
    #[tracing::instrument(name = "csi.probe", skip_all)]
    async fn probe(
        &self,
        _: tonic::Request<csi::ProbeRequest>,
    ) -> Result<tonic::Response<csi::ProbeResponse>, tonic::Status> {
        let ready = self.0.registry.is_ready();
        self.0.observe("Probe", async { Ok(csi::ProbeResponse { ready: Some(ready) }) }).await
    }
}
