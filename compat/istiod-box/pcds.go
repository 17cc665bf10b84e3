package main

import (
	"encoding/pem"
	"fmt"
	"io"
	"net/http"
	"strings"

	meshconfig "istio.io/api/mesh/v1alpha1"
	"istio.io/istio/pilot/pkg/features"
	"istio.io/istio/pilot/pkg/model"
	"istio.io/istio/pilot/pkg/trustbundle"
	"istio.io/istio/pilot/pkg/xds"
	v3 "istio.io/istio/pilot/pkg/xds/v3"
	xdsfake "istio.io/istio/pilot/test/xds"
	"istio.io/istio/pkg/config/mesh/meshwatcher"
)

// PCDS (the ProxyConfig type, pilot/pkg/xds/pcds.go) is only answered with
// ISTIO_MULTIROOT_MESH on and a trust bundle behind the generator, which istiod wires in
// pilot/pkg/bootstrap/server.go (NewServer: tb.NewTrustBundle; initWorkloadTrustBundle: the
// push on update; addIstioCAToTrustBundle: the CA's root) and pilot/pkg/bootstrap/discovery.go
// (InitGenerators). The fake discovery server builds its environment without one, so
// --multi-root-mesh does the same wiring here.

// multiRootMesh is set before the fake server is built: the feature is a package variable
// read at init (env.Register(...).Get()), like those of applyEnvoyCompatibility.
func multiRootMesh() {
	features.MultiRootMesh = true
}

// pcds holds the trust bundle PCDS serves; nil without --multi-root-mesh.
type pcds struct {
	tb *trustbundle.TrustBundle
}

// wirePCDS gives the fake server's PCDS generator a trust bundle holding the CA's root, and
// pushes (Forced, as istiod's update callback does) whenever the bundle changes.
func wirePCDS(ds *xdsfake.FakeDiscoveryServer, m *meshconfig.MeshConfig, rootPEM []byte) (*pcds, error) {
	tb := trustbundle.NewTrustBundle(nil, meshwatcher.NewTestWatcher(m))
	if err := tb.UpdateTrustAnchor(&trustbundle.TrustAnchorUpdate{
		TrustAnchorConfig: trustbundle.TrustAnchorConfig{Certs: []string{string(rootPEM)}},
		Source:            trustbundle.SourceIstioCA,
	}); err != nil {
		return nil, fmt.Errorf("adding the CA root to the trust bundle: %w", err)
	}
	tb.UpdateCb(func() {
		ds.Discovery.ConfigUpdate(&model.PushRequest{
			Reason: model.NewReasonStats(model.GlobalUpdate),
			Forced: true,
		})
	})
	ds.Discovery.Generators[v3.ProxyConfigType] = &xds.PcdsGenerator{TrustBundle: tb}
	return &pcds{tb: tb}, nil
}

// serve: PUT /trust-anchors with a PEM body sets the extra trust anchors (what istiod reads
// from meshConfig caCertificates, trustbundle.SourceMeshConfig; an empty body clears them),
// which pushes PCDS; GET lists the merged bundle PCDS sends.
func (p *pcds) serve(w http.ResponseWriter, r *http.Request) {
	if p == nil {
		http.Error(w, "PCDS is off: start istiod-box with --multi-root-mesh", http.StatusNotFound)
		return
	}
	switch r.Method {
	case http.MethodGet:
		_, _ = io.WriteString(w, strings.Join(p.tb.GetTrustBundle(), ""))
	case http.MethodPut:
		body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
		if err != nil {
			http.Error(w, fmt.Sprintf("reading the body: %v", err), http.StatusBadRequest)
			return
		}
		certs := []string{}
		for rest := body; ; {
			var b *pem.Block
			b, rest = pem.Decode(rest)
			if b == nil {
				break
			}
			certs = append(certs, string(pem.EncodeToMemory(b)))
		}
		if len(certs) == 0 && len(strings.TrimSpace(string(body))) > 0 {
			http.Error(w, "the body holds no PEM block", http.StatusBadRequest)
			return
		}
		if err := p.tb.UpdateTrustAnchor(&trustbundle.TrustAnchorUpdate{
			TrustAnchorConfig: trustbundle.TrustAnchorConfig{Certs: certs},
			Source:            trustbundle.SourceMeshConfig,
		}); err != nil {
			http.Error(w, fmt.Sprintf("updating the trust bundle: %v", err), http.StatusBadRequest)
			return
		}
		_, _ = fmt.Fprintf(w, "%d trust anchors from the mesh config\n", len(certs))
	default:
		http.Error(w, "GET or PUT", http.StatusMethodNotAllowed)
	}
}
