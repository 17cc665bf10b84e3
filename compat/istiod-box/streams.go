package main

import (
	"encoding/json"
	"net/http"
	"sort"
	"sync"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/encoding/protojson"
)

// streamRecord is one gRPC stream opened on the TLS port (ADS, SotW or Delta) as istiod
// received it, with its first request's node and type, and every message both ways: the
// differential tests compare what the real pilot-agent and meshagent open upstream and send on
// it (tests/compat_xds.rs, tests/compat_wire.rs).
type streamRecord struct {
	Time       string              `json:"time"`
	Method     string              `json:"method"`
	Peer       string              `json:"peer"`
	ClientCert bool                `json:"client_cert"`
	Headers    map[string][]string `json:"headers"`
	// The first request's type URL and node (protobuf JSON; null until a request came).
	TypeURL string          `json:"type_url"`
	Node    json.RawMessage `json:"node"`
	// Every request received and response sent on the stream, in order (the first
	// maxMessages; Dropped counts the rest).
	Messages []wireMessage `json:"messages"`
	Dropped  int           `json:"dropped"`
}

// wireMessage is one xDS message on a stream: a request the agent sent ("recv", as istiod
// received it) or a response istiod sent ("send"). The fields are those of
// DiscoveryRequest/DiscoveryResponse and their Delta forms; a response's resources are named
// only for Delta (SotW's are Any-wrapped protos, counted).
type wireMessage struct {
	Time string `json:"time"`
	Dir  string `json:"dir"`
	// Delta or SotW.
	Delta         bool   `json:"delta"`
	TypeURL       string `json:"type_url"`
	VersionInfo   string `json:"version_info,omitempty"`
	Nonce         string `json:"nonce,omitempty"`
	ResponseNonce string `json:"response_nonce,omitempty"`
	// Whether the request carried a node (Envoy sends it on the first request only, unless
	// set_node_on_first_message_only is off).
	HasNode bool `json:"has_node,omitempty"`
	// SotW requests: resource_names; Delta requests: resource_names_subscribe.
	ResourceNames []string `json:"resource_names,omitempty"`
	// Delta requests: resource_names_unsubscribe and initial_resource_versions' names.
	Unsubscribe      []string `json:"unsubscribe,omitempty"`
	InitialResources []string `json:"initial_resources,omitempty"`
	// A NACK's error_detail message.
	ErrorDetail string `json:"error_detail,omitempty"`
	// Responses: how many resources, and (Delta) their names and the removed names.
	ResourceCount int      `json:"resource_count,omitempty"`
	Removed       []string `json:"removed,omitempty"`
}

// streamLog keeps the last maxStreams streams.
type streamLog struct {
	mu      sync.Mutex
	records []*streamRecord
}

const (
	maxStreams = 256
	// maxMessages bounds one stream's message record.
	maxMessages = 2000
)

// firstRequest is what both DiscoveryRequest and DeltaDiscoveryRequest offer.
type firstRequest interface {
	GetNode() *core.Node
	GetTypeUrl() string
}

// recvStream records the messages of a stream.
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
		s.add(describeMessage(m, "recv"))
	}
	return err
}

func (s *recvStream) SendMsg(m any) error {
	err := s.ServerStream.SendMsg(m)
	if err == nil {
		s.add(describeMessage(m, "send"))
	}
	return err
}

func (s *recvStream) add(w *wireMessage) {
	if w == nil {
		return
	}
	s.log.mu.Lock()
	defer s.log.mu.Unlock()
	if len(s.rec.Messages) >= maxMessages {
		s.rec.Dropped++
		return
	}
	s.rec.Messages = append(s.rec.Messages, *w)
}

// describeMessage is the record of one xDS message (nil for anything else).
func describeMessage(m any, dir string) *wireMessage {
	w := &wireMessage{Time: time.Now().UTC().Format(time.RFC3339Nano), Dir: dir}
	switch r := m.(type) {
	case *discovery.DiscoveryRequest:
		w.TypeURL, w.VersionInfo, w.ResponseNonce = r.GetTypeUrl(), r.GetVersionInfo(), r.GetResponseNonce()
		w.HasNode = r.GetNode() != nil
		w.ResourceNames = r.GetResourceNames()
		w.ErrorDetail = r.GetErrorDetail().GetMessage()
	case *discovery.DeltaDiscoveryRequest:
		w.Delta = true
		w.TypeURL, w.ResponseNonce = r.GetTypeUrl(), r.GetResponseNonce()
		w.HasNode = r.GetNode() != nil
		w.ResourceNames = r.GetResourceNamesSubscribe()
		w.Unsubscribe = r.GetResourceNamesUnsubscribe()
		for name := range r.GetInitialResourceVersions() {
			w.InitialResources = append(w.InitialResources, name)
		}
		sort.Strings(w.InitialResources)
		w.ErrorDetail = r.GetErrorDetail().GetMessage()
	case *discovery.DiscoveryResponse:
		w.TypeURL, w.VersionInfo, w.Nonce = r.GetTypeUrl(), r.GetVersionInfo(), r.GetNonce()
		w.ResourceCount = len(r.GetResources())
	case *discovery.DeltaDiscoveryResponse:
		w.Delta = true
		w.TypeURL, w.VersionInfo, w.Nonce = r.GetTypeUrl(), r.GetSystemVersionInfo(), r.GetNonce()
		w.ResourceCount = len(r.GetResources())
		for _, res := range r.GetResources() {
			w.ResourceNames = append(w.ResourceNames, res.GetName())
		}
		w.Removed = r.GetRemovedResources()
	default:
		return nil
	}
	return w
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
