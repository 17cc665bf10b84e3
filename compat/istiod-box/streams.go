package main

import (
	"encoding/json"
	"net/http"
	"sync"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/encoding/protojson"
)

// streamRecord is one gRPC stream opened on the TLS port (ADS, SotW or Delta) as istiod
// received it, with its first request's node and type: the differential tests compare what the
// real pilot-agent and meshagent open upstream (tests/compat_xds.rs).
type streamRecord struct {
	Time       string              `json:"time"`
	Method     string              `json:"method"`
	Peer       string              `json:"peer"`
	ClientCert bool                `json:"client_cert"`
	Headers    map[string][]string `json:"headers"`
	// The first request's type URL and node (protobuf JSON; null until a request came).
	TypeURL string          `json:"type_url"`
	Node    json.RawMessage `json:"node"`
}

// streamLog keeps the last maxStreams streams.
type streamLog struct {
	mu      sync.Mutex
	records []*streamRecord
}

const maxStreams = 256

// firstRequest is what both DiscoveryRequest and DeltaDiscoveryRequest offer.
type firstRequest interface {
	GetNode() *core.Node
	GetTypeUrl() string
}

// recvStream records the first message received on a stream.
type recvStream struct {
	grpc.ServerStream
	once sync.Once
	log  *streamLog
	rec  *streamRecord
}

func (s *recvStream) RecvMsg(m any) error {
	err := s.ServerStream.RecvMsg(m)
	if err == nil {
		s.once.Do(func() {
			r, ok := m.(firstRequest)
			if !ok {
				return
			}
			s.log.mu.Lock()
			defer s.log.mu.Unlock()
			s.rec.TypeURL = r.GetTypeUrl()
			if n := r.GetNode(); n != nil {
				if b, err := protojson.Marshal(n); err == nil {
					s.rec.Node = b
				}
			}
		})
	}
	return err
}

// interceptor records every stream opened, then serves it.
func (l *streamLog) interceptor(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo,
	handler grpc.StreamHandler,
) error {
	rec := &streamRecord{
		Time:   time.Now().UTC().Format(time.RFC3339Nano),
		Method: info.FullMethod,
		Node:   json.RawMessage("null"),
	}
	rec.Peer, rec.ClientCert, rec.Headers = callInfo(ss.Context())
	l.mu.Lock()
	l.records = append(l.records, rec)
	if len(l.records) > maxStreams {
		l.records = l.records[len(l.records)-maxStreams:]
	}
	l.mu.Unlock()
	return handler(srv, &recvStream{ServerStream: ss, log: l, rec: rec})
}

// serve answers GET /streams (oldest first, as JSON) and DELETE /streams (clears them).
func (l *streamLog) serve(w http.ResponseWriter, r *http.Request) {
	serveRecords(w, r, &l.mu, &l.records)
}
