// Command istiod-box runs Istio's own control-plane code on loopback as a reference istiod for
// meshagent's tests: real config generation (pilot/test/xds/fake.go NewFakeDiscoveryServer over
// in-memory Kubernetes clients), the real Istio CA (security/pkg/pki/ca, security/pkg/server/ca)
// with Istio's client-certificate and JWT authenticators, ADS on a TLS and a plaintext gRPC port
// and istiod's debug endpoints on HTTP. It is built from the istio.io/istio module pinned by
// compat/go.mod; see README.md beside this file.
package main

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	meshconfig "istio.io/api/mesh/v1alpha1"
	"istio.io/api/security/v1beta1"
	"istio.io/istio/pilot/pkg/features"
	istiogrpc "istio.io/istio/pilot/pkg/grpc"
	xdsfake "istio.io/istio/pilot/test/xds"
	"istio.io/istio/pkg/config/mesh"
	"istio.io/istio/pkg/config/mesh/meshwatcher"
	"istio.io/istio/pkg/keepalive"
	"istio.io/istio/pkg/log"
	"istio.io/istio/pkg/security"
	"istio.io/istio/security/pkg/pki/ca"
	caserver "istio.io/istio/security/pkg/server/ca"
	"istio.io/istio/security/pkg/server/ca/authenticate"
)

// istiodNames are the names istiod's serving certificate carries (pilot/pkg/bootstrap/certcontroller.go
// uses istiod.<ns>.svc and friends); agents verify the server name istiod.istio-system.svc.
var istiodNames = []string{
	"istiod.istio-system.svc",
	"istiod.istio-system.svc.cluster.local",
	"istiod.istio-system",
	"istiod",
	"istio-pilot.istio-system.svc",
	"localhost",
	"127.0.0.1",
}

type options struct {
	configPath      string
	meshPath        string
	listenIP        string
	grpcTLSPort     int
	grpcPlainPort   int
	httpPort        int
	readyFile       string
	stateDir        string
	rootCertOut     string
	istioExtensions bool
	legacyAutoalloc bool
	debounce        time.Duration
	workloadCertTTL time.Duration
	audience        string
	logLevel        string
	multiRootMesh   bool
}

func parseFlags() options {
	var o options
	fs := flag.NewFlagSet("istiod-box", flag.ExitOnError)
	fs.StringVar(&o.configPath, "config", "", "YAML file of Kubernetes objects (Service, Pod, EndpointSlice, Namespace, ...) and Istio resources (ServiceEntry, WorkloadEntry, Sidecar, ...); optional")
	fs.StringVar(&o.meshPath, "mesh", "", "mesh config YAML (MeshConfig, as in istiod's `mesh` ConfigMap key); optional")
	fs.StringVar(&o.listenIP, "listen-ip", "127.0.0.1", "IP every port binds to")
	fs.IntVar(&o.grpcTLSPort, "grpc-tls-port", 0, "TLS gRPC port with ADS and the Istio CA, like istiod's 15012 (0 = a free port)")
	fs.IntVar(&o.grpcPlainPort, "grpc-plain-port", 0, "plaintext gRPC port with ADS, like istiod's 15010 (0 = a free port)")
	fs.IntVar(&o.httpPort, "http-port", 0, "HTTP port: istiod's /debug endpoints, /ready, /jwks, /token, /apply (0 = a free port)")
	fs.StringVar(&o.readyFile, "ready-file", "", "once serving, write the addresses as JSON to this file (also printed as one line on stdout)")
	fs.StringVar(&o.stateDir, "state-dir", "", "directory for root-cert.pem (default: a new temporary directory)")
	fs.StringVar(&o.rootCertOut, "root-cert", "", "also write the CA's root certificate to this path")
	fs.BoolVar(&o.istioExtensions, "istio-extensions", false, "keep istiod's defaults that need Istio's Envoy build (metadata exchange, istio.alpn, prometheus stats); off by default so upstream Envoy loads the config")
	fs.BoolVar(&o.legacyAutoalloc, "legacy-ip-autoallocate", false, "allocate ServiceEntry addresses in the ServiceEntry registry for proxies with ISTIO_META_DNS_AUTO_ALLOCATE (PILOT_ENABLE_IP_AUTOALLOCATE=false); by default istiod's IP autoallocate controller would, which istiod-box does not run, so ServiceEntries without addresses get none")
	fs.DurationVar(&o.debounce, "debounce", 100*time.Millisecond, "istiod's push debounce (PILOT_DEBOUNCE_AFTER)")
	fs.DurationVar(&o.workloadCertTTL, "workload-cert-ttl", 24*time.Hour, "default TTL of workload certificates the CA signs")
	fs.StringVar(&o.audience, "audience", "istio-ca", "audience of issued tokens and the one the JWT authenticator accepts")
	fs.BoolVar(&o.multiRootMesh, "multi-root-mesh", false, "ISTIO_MULTIROOT_MESH: serve PCDS (the ProxyConfig type) with a trust bundle of the CA root and whatever PUT /trust-anchors sets (pcds.go)")
	fs.StringVar(&o.logLevel, "log-level", "default:info", "Istio log levels, as istiod's --log_output_level")
	_ = fs.Parse(os.Args[1:])
	if fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "istiod-box: unexpected arguments %q\n", fs.Args())
		os.Exit(2)
	}
	return o
}

func fatalf(format string, a ...any) {
	fmt.Fprintf(os.Stderr, "istiod-box: "+format+"\n", a...)
	os.Exit(1)
}

func main() {
	o := parseFlags()

	logOpts := log.DefaultOptions()
	// Logs go to stderr so stdout carries only the ready line.
	logOpts.OutputPaths = []string{"stderr"}
	logOpts.SetDefaultOutputLevel(log.DefaultScopeName, log.InfoLevel)
	for _, sl := range strings.Split(o.logLevel, ",") {
		scope, level, ok := strings.Cut(strings.TrimSpace(sl), ":")
		if !ok || scope == "" {
			fatalf("--log-level %q: want scope:level[,scope:level...]", o.logLevel)
		}
		switch level {
		case "none", "error", "warn", "info", "debug":
			logOpts.SetDefaultOutputLevel(scope, log.StringToLevel(level))
		default:
			fatalf("--log-level %q: level %q is not one of none, error, warn, info, debug", o.logLevel, level)
		}
	}
	if err := log.Configure(logOpts); err != nil {
		fatalf("configuring logging: %v", err)
	}

	m := mesh.DefaultMeshConfig()
	if o.meshPath != "" {
		data, err := os.ReadFile(o.meshPath)
		if err != nil {
			fatalf("--mesh: %v", err)
		}
		if m, err = mesh.ApplyMeshConfigDefaults(string(data)); err != nil {
			fatalf("--mesh %s: %v", o.meshPath, err)
		}
	}
	applyEnvoyCompatibility(m, o.istioExtensions)
	if o.multiRootMesh {
		multiRootMesh()
	}
	if o.legacyAutoalloc {
		// PILOT_ENABLE_IP_AUTOALLOCATE (pilot/pkg/features/pilot.go), read once at init like
		// the features above: off, the ServiceEntry registry allocates 240.240.0.0/16 addresses
		// itself (pilot/pkg/serviceregistry/serviceentry/auto_allocation.go autoAllocateIPs),
		// which proxies with DNSAutoAllocate metadata and DNS capture get in their NDS table
		// (pilot/pkg/model/service.go nodeUsesAutoallocatedIPs).
		features.EnableIPAutoallocate = false
	}

	var istioDocs, kubeDocs []string
	if o.configPath != "" {
		data, err := os.ReadFile(o.configPath)
		if err != nil {
			fatalf("--config: %v", err)
		}
		if istioDocs, kubeDocs, err = splitByKind(string(data)); err != nil {
			fatalf("--config %s: %v", o.configPath, err)
		}
	}

	if o.stateDir == "" {
		d, err := os.MkdirTemp("", "istiod-box-state-")
		if err != nil {
			fatalf("state dir: %v", err)
		}
		o.stateDir = d
	}
	if abs, err := filepath.Abs(o.stateDir); err == nil {
		o.stateDir = abs
	}

	// Listeners first: the JWT issuer and JWKS URI name the HTTP port.
	listen := func(what string, port int) net.Listener {
		l, err := net.Listen("tcp", net.JoinHostPort(o.listenIP, strconv.Itoa(port)))
		if err != nil {
			fatalf("listening for %s on %s port %d: %v", what, o.listenIP, port, err)
		}
		return l
	}
	tlsL := listen("TLS gRPC", o.grpcTLSPort)
	plainL := listen("plaintext gRPC", o.grpcPlainPort)
	httpL := listen("HTTP", o.httpPort)
	issuerURL := "http://" + httpL.Addr().String()

	// The CA, as istiod runs it without plugged certs (pilot/pkg/bootstrap/istio_ca.go):
	// self-signed root, workload certs for the caller's identity.
	caOpts, err := ca.NewSelfSignedDebugIstioCAOptions("", 10*365*24*time.Hour, o.workloadCertTTL,
		90*24*time.Hour, m.GetTrustDomain(), 2048)
	if err != nil {
		fatalf("CA: %v", err)
	}
	istioCA, err := ca.NewIstioCA(caOpts)
	if err != nil {
		fatalf("CA: %v", err)
	}
	rootPEM := istioCA.GetCAKeyCertBundle().GetRootCertPem()
	rootPath := filepath.Join(o.stateDir, "root-cert.pem")
	for _, p := range []string{rootPath, o.rootCertOut} {
		if p == "" {
			continue
		}
		if err := writeFile(p, rootPEM); err != nil {
			fatalf("root certificate: %v", err)
		}
	}
	servingCertPEM, servingKeyPEM, err := istioCA.GenKeyCert(istiodNames, 365*24*time.Hour, false)
	if err != nil {
		fatalf("istiod serving certificate: %v", err)
	}
	servingCert, err := tls.X509KeyPair(servingCertPEM, servingKeyPEM)
	if err != nil {
		fatalf("istiod serving certificate: %v", err)
	}

	tokens, err := newTokenIssuer(issuerURL, o.audience)
	if err != nil {
		fatalf("%v", err)
	}
	// Istio's authenticators as istiod configures them for the CA and for XDS
	// (pilot/pkg/bootstrap/server.go, authenticators): client certificates signed by our root,
	// and third-party JWTs verified against the issuer's JWKS.
	jwtAuth, err := authenticate.NewJwtAuthenticator(&v1beta1.JWTRule{
		Issuer:    issuerURL,
		JwksUri:   issuerURL + "/jwks",
		Audiences: []string{o.audience},
	}, meshwatcher.NewTestWatcher(m))
	if err != nil {
		fatalf("JWT authenticator: %v", err)
	}
	authenticators := []security.Authenticator{&authenticate.ClientCertAuthenticator{}, jwtAuth}

	failer := &processFailer{}
	start := time.Now()
	ds := xdsfake.NewFakeDiscoveryServer(failer, xdsfake.FakeOptions{
		ConfigString:           joinDocs(istioDocs),
		KubernetesObjectString: joinDocs(kubeDocs),
		MeshConfig:             m,
		DebounceTime:           o.debounce,
	})
	ds.Discovery.Authenticators = authenticators
	var trust *pcds
	if o.multiRootMesh {
		if trust, err = wirePCDS(ds, m, rootPEM); err != nil {
			fatalf("PCDS: %v", err)
		}
	}
	log.Infof("istiod config generation ready in %v (%d Istio, %d Kubernetes documents)",
		time.Since(start).Round(time.Millisecond), len(istioDocs), len(kubeDocs))

	caSrv, err := caserver.New(istioCA, o.workloadCertTTL, authenticators, nil)
	if err != nil {
		fatalf("CA server: %v", err)
	}

	// istiod's gRPC server options (pilot/pkg/bootstrap/server.go initSecureDiscoveryService):
	// keepalive enforcement matching agents' pings, message size limits.
	grpcOpts := istiogrpc.ServerOptions(keepalive.DefaultOption(), func(int64) {})
	// The TLS server (the CA's) also records what each agent asks the CA for (csrs.go).
	csrs := &csrLog{}
	tlsOpts := istiogrpc.ServerOptions(keepalive.DefaultOption(), func(int64) {}, csrs.interceptor)
	// ... and the streams each opens, with their first request's node (streams.go).
	streams := &streamLog{}
	tlsOpts = append(tlsOpts, grpc.ChainStreamInterceptor(streams.interceptor))
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(rootPEM)
	tlsCreds := credentials.NewTLS(&tls.Config{
		Certificates: []tls.Certificate{servingCert},
		// Agents present their workload certificate once they have one (ClientCertAuthenticator
		// reads the verified chain); before that they authenticate with the token.
		ClientAuth: tls.VerifyClientCertIfGiven,
		ClientCAs:  roots,
		MinVersion: tls.VersionTLS12,
	})
	tlsSrv := grpc.NewServer(append(tlsOpts, grpc.Creds(tlsCreds))...)
	ds.Discovery.Register(tlsSrv)
	caSrv.Register(tlsSrv)
	plainSrv := grpc.NewServer(grpcOpts...)
	ds.Discovery.Register(plainSrv)

	box := &box{ds: ds, tokens: tokens, rootPEM: rootPEM, applier: &applier{ds: ds}}
	mux := http.NewServeMux()
	// istiod's own debug handlers, as pilot/pkg/bootstrap/server.go registers them on its HTTP
	// mux (localhost callers need no authentication: pilot/pkg/xds/debug.go).
	ds.Discovery.InitDebug(mux, false, func() map[string]string { return nil })
	box.routes(mux)
	// GET /csrs: the CreateCertificate calls received (csrs.go); DELETE /csrs clears them.
	mux.HandleFunc("/csrs", csrs.serve)
	// GET /streams: the gRPC streams opened on the TLS port (streams.go); DELETE clears them.
	mux.HandleFunc("/streams", streams.serve)
	// PUT /trust-anchors: extra trust anchors for PCDS (pcds.go, --multi-root-mesh).
	mux.HandleFunc("/trust-anchors", trust.serve)
	httpSrv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}

	serveErr := make(chan error, 3)
	go func() { serveErr <- fmt.Errorf("TLS gRPC server: %w", tlsSrv.Serve(tlsL)) }()
	go func() { serveErr <- fmt.Errorf("plaintext gRPC server: %w", plainSrv.Serve(plainL)) }()
	go func() { serveErr <- fmt.Errorf("HTTP server: %w", httpSrv.Serve(httpL)) }()

	ready, _ := json.Marshal(map[string]string{
		"grpc_tls":   tlsL.Addr().String(),
		"grpc_plain": plainL.Addr().String(),
		"http":       httpL.Addr().String(),
		"root_cert":  rootPath,
		"issuer":     issuerURL,
		"jwks_uri":   issuerURL + "/jwks",
		"audience":   o.audience,
	})
	box.ready.Store(true)
	if o.readyFile != "" {
		if err := writeFile(o.readyFile, ready); err != nil {
			fatalf("--ready-file: %v", err)
		}
	}
	fmt.Println(string(ready))

	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	select {
	case s := <-sig:
		log.Infof("%v: shutting down", s)
	case err := <-serveErr:
		fatalf("%v", err)
	}
	tlsSrv.Stop()
	plainSrv.Stop()
	_ = httpSrv.Close()
	failer.shutdown()
}

// applyEnvoyCompatibility keeps istiod's output loadable by upstream Envoy (README.md,
// "Envoy compatibility"), unless istioExtensions asks for istiod's defaults.
//
// The features are package variables read once at init (pilot/pkg/features/telemetry.go,
// pilot.go: env.Register(...).Get()), so setting the environment in main would be too late;
// they are set here, before the first push context is built.
func applyEnvoyCompatibility(m *meshconfig.MeshConfig, istioExtensions bool) {
	if istioExtensions {
		// An installed istiod gets `defaultProviders.metrics: [prometheus]` from its Helm chart
		// (manifests/charts/istio-control/istio-discovery/templates/configmap.yaml), which makes
		// pilot/pkg/model/telemetry.go add the istio.stats filters.
		if m.DefaultProviders == nil {
			m.DefaultProviders = &meshconfig.MeshConfig_DefaultProviders{}
		}
		if len(m.DefaultProviders.Metrics) == 0 {
			m.DefaultProviders.Metrics = []string{"prometheus"}
		}
		return
	}
	// PILOT_ENABLE_METADATA_EXCHANGE: istio.metadata_exchange network filters on inbound
	// listeners and outbound clusters (pilot/pkg/networking/core/networkfilter.go,
	// cluster_builder.go) and the io.istio.http.peer_metadata HTTP filters
	// (listener_builder.go appendMxFilter) are Istio-proxy extensions.
	features.MetadataExchange = false
	// PILOT_ENABLE_ALPN_FILTER: the istio.alpn HTTP filter on outbound HCMs
	// (pilot/pkg/networking/core/listener_builder.go) is an Istio-proxy extension.
	features.ALPNFilter = false
	// No default metrics provider: mesh.DefaultMeshConfig already has none, but a --mesh file
	// may name one; stats filters (istio.stats) then come only from a Telemetry resource.
	if m.DefaultProviders != nil {
		m.DefaultProviders.Metrics = nil
	}
}

// box holds what the HTTP endpoints beside istiod's debug handlers need.
type box struct {
	ds      *xdsfake.FakeDiscoveryServer
	tokens  *tokenIssuer
	rootPEM []byte
	applier *applier
	ready   atomic.Bool
}

func (b *box) routes(mux *http.ServeMux) {
	mux.HandleFunc("/ready", func(w http.ResponseWriter, _ *http.Request) {
		if !b.ready.Load() {
			http.Error(w, "not ready", http.StatusServiceUnavailable)
			return
		}
		_, _ = io.WriteString(w, "ready\n")
	})
	mux.HandleFunc("/jwks", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(b.tokens.jwks())
	})
	mux.HandleFunc("/root-cert", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write(b.rootPEM)
	})
	// GET /token?namespace=NS&serviceAccount=SA[&ttlSeconds=N][&dir=DIR]: a token for NS/SA;
	// with dir, the token and the root certificate are also written where an agent running
	// in DIR reads them (./var/run/secrets/tokens/istio-token, ./var/run/secrets/istio/root-cert.pem).
	mux.HandleFunc("/token", func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		ttl := time.Hour * 24
		if s := q.Get("ttlSeconds"); s != "" {
			n, err := strconv.Atoi(s)
			if err != nil || n <= 0 {
				http.Error(w, fmt.Sprintf("ttlSeconds %q: want a positive integer", s), http.StatusBadRequest)
				return
			}
			ttl = time.Duration(n) * time.Second
		}
		tok, err := b.tokens.token(q.Get("namespace"), q.Get("serviceAccount"), ttl)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		if dir := q.Get("dir"); dir != "" {
			if err := writePodSecrets(dir, tok, b.rootPEM); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
		}
		_, _ = io.WriteString(w, tok+"\n")
	})
	// POST /apply (YAML body): create or update; DELETE /apply or POST /delete: delete.
	apply := func(remove bool) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			body, err := io.ReadAll(io.LimitReader(r.Body, 64<<20))
			if err != nil {
				http.Error(w, "reading body: "+err.Error(), http.StatusBadRequest)
				return
			}
			done, err := b.applier.apply(string(body), remove)
			out := strings.Join(done, "\n")
			if err != nil {
				http.Error(w, out+"\nerror: "+err.Error(), http.StatusBadRequest)
				return
			}
			log.Infof("applied: %s", strings.ReplaceAll(out, "\n", "; "))
			_, _ = io.WriteString(w, out+"\n")
		}
	}
	mux.HandleFunc("/apply", func(w http.ResponseWriter, r *http.Request) {
		switch r.Method {
		case http.MethodPost, http.MethodPut:
			apply(false)(w, r)
		case http.MethodDelete:
			apply(true)(w, r)
		default:
			http.Error(w, "POST, PUT or DELETE a YAML body", http.StatusMethodNotAllowed)
		}
	})
	mux.HandleFunc("/delete", func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			http.Error(w, "POST a YAML body", http.StatusMethodNotAllowed)
			return
		}
		apply(true)(w, r)
	})
}
