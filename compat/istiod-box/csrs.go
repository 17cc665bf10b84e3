package main

import (
	"context"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"net/http"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	pb "istio.io/api/security/v1alpha1"
)

// createCertificate is the CA's one method (istio.io/api security/v1alpha1/ca.proto).
const createCertificate = "/istio.v1.auth.IstioCertificateService/CreateCertificate"

// maxCSRs bounds the record: the oldest entries go first.
const maxCSRs = 256

// csrRecord is one CreateCertificate call as the CA received it, for the differential tests
// that compare what the real pilot-agent and meshagent ask for (tests/compat_identity.rs).
type csrRecord struct {
	Time string `json:"time"`
	// The caller's address (each agent's connection has its own port).
	Peer string `json:"peer"`
	// Whether the caller presented a TLS client certificate (a renewal authenticated by the
	// workload certificate, security/pkg/server/ca/authenticate/cert_authenticator.go).
	ClientCert bool `json:"client_cert"`
	// The gRPC request headers; authorization values keep only their scheme.
	Headers          map[string][]string `json:"headers"`
	CSR              string              `json:"csr"`
	ValidityDuration int64               `json:"validity_duration"`
	// The request's metadata Struct in protobuf JSON (null when absent).
	Metadata json.RawMessage `json:"metadata"`
	// The gRPC status code of the answer ("OK" when a certificate was issued).
	Code string `json:"code"`
	// When the call arrived, in Unix milliseconds (Time's instant, for arithmetic).
	TimeUnixMs int64 `json:"time_unix_ms"`
	// The issued leaf certificate's validity in Unix seconds (0 when none was issued): the
	// rotation differential measures each agent's next CSR against it.
	NotBefore int64 `json:"not_before,omitempty"`
	NotAfter  int64 `json:"not_after,omitempty"`
}

// csrLog keeps the last maxCSRs CreateCertificate calls.
type csrLog struct {
	mu      sync.Mutex
	records []csrRecord
}

// interceptor records each CreateCertificate call and its outcome; other methods pass through.
func (l *csrLog) interceptor(ctx context.Context, req any, info *grpc.UnaryServerInfo,
	handler grpc.UnaryHandler,
) (any, error) {
	r, ok := req.(*pb.IstioCertificateRequest)
	if info.FullMethod != createCertificate || !ok {
		return handler(ctx, req)
	}
	now := time.Now()
	rec := csrRecord{
		Time:             now.UTC().Format(time.RFC3339Nano),
		TimeUnixMs:       now.UnixMilli(),
		CSR:              r.GetCsr(),
		ValidityDuration: r.GetValidityDuration(),
		Metadata:         json.RawMessage("null"),
	}
	rec.Peer, rec.ClientCert, rec.Headers = callInfo(ctx)
	if r.GetMetadata() != nil {
		if b, err := protojson.Marshal(r.GetMetadata()); err == nil {
			rec.Metadata = b
		}
	}
	resp, err := handler(ctx, req)
	rec.Code = status.Code(err).String()
	if r, ok := resp.(*pb.IstioCertificateResponse); ok && len(r.GetCertChain()) > 0 {
		if b, _ := pem.Decode([]byte(r.GetCertChain()[0])); b != nil {
			if c, err := x509.ParseCertificate(b.Bytes); err == nil {
				rec.NotBefore = c.NotBefore.Unix()
				rec.NotAfter = c.NotAfter.Unix()
			}
		}
	}
	l.mu.Lock()
	l.records = append(l.records, rec)
	if len(l.records) > maxCSRs {
		l.records = l.records[len(l.records)-maxCSRs:]
	}
	l.mu.Unlock()
	return resp, err
}

// callInfo is the caller's address, whether it presented a TLS client certificate, and its
// gRPC request headers with authorization values cut to their scheme.
func callInfo(ctx context.Context) (addr string, clientCert bool, headers map[string][]string) {
	headers = map[string][]string{}
	if p, ok := peer.FromContext(ctx); ok {
		addr = p.Addr.String()
		if ti, ok := p.AuthInfo.(credentials.TLSInfo); ok {
			clientCert = len(ti.State.PeerCertificates) > 0
		}
	}
	if md, ok := metadata.FromIncomingContext(ctx); ok {
		for k, vs := range md {
			for _, v := range vs {
				if k == "authorization" {
					scheme, _, _ := strings.Cut(v, " ")
					v = scheme + " <redacted>"
				}
				headers[k] = append(headers[k], v)
			}
		}
	}
	return addr, clientCert, headers
}

// serve answers GET /csrs (the record, oldest first, as JSON) and DELETE /csrs (clears it).
func (l *csrLog) serve(w http.ResponseWriter, r *http.Request) {
	serveRecords(w, r, &l.mu, &l.records)
}

// serveRecords answers GET with the records (oldest first, as a JSON array) and DELETE by
// clearing them, under mu.
func serveRecords[T any](w http.ResponseWriter, r *http.Request, mu *sync.Mutex, records *[]T) {
	mu.Lock()
	defer mu.Unlock()
	switch r.Method {
	case http.MethodGet:
		w.Header().Set("Content-Type", "application/json")
		out := *records
		if out == nil {
			out = []T{}
		}
		_ = json.NewEncoder(w).Encode(out)
	case http.MethodDelete:
		*records = nil
		w.WriteHeader(http.StatusNoContent)
	default:
		http.Error(w, "GET or DELETE", http.StatusMethodNotAllowed)
	}
}
