package main

import (
	"context"
	"fmt"
	"regexp"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/yaml"

	"istio.io/istio/pilot/pkg/config/kube/crd"
	xdsfake "istio.io/istio/pilot/test/xds"
	"istio.io/istio/pkg/config"
	kubelib "istio.io/istio/pkg/kube"
)

var docSeparator = regexp.MustCompile(`(?m)^---[ \t]*$`)

// splitDocs splits a multi-document YAML stream into its non-empty documents.
func splitDocs(s string) []string {
	var out []string
	for _, d := range docSeparator.Split(s, -1) {
		if strings.TrimSpace(stripComments(d)) != "" {
			out = append(out, d)
		}
	}
	return out
}

func stripComments(doc string) string {
	var b strings.Builder
	for _, l := range strings.Split(doc, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(l), "#") {
			b.WriteString(l)
			b.WriteByte('\n')
		}
	}
	return b.String()
}

type typeMeta struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Metadata   struct {
		Name      string `json:"name"`
		Namespace string `json:"namespace"`
	} `json:"metadata"`
}

// isIstioConfig says whether a document belongs in FakeOptions.ConfigString (Istio's config
// store: networking/security/telemetry/extensions.istio.io and Gateway API, parsed by
// pilot/pkg/config/kube/crd) rather than KubernetesObjectString (the fake Kubernetes client:
// Services, Pods, EndpointSlices, Namespaces, ...; pilot/test/xds/fake.go decodes those with
// kubelib.IstioCodec).
func isIstioConfig(apiVersion string) bool {
	group, _, _ := strings.Cut(apiVersion, "/")
	return strings.HasSuffix(group, ".istio.io") || group == "gateway.networking.k8s.io"
}

// splitByKind splits the input into Istio config documents and Kubernetes object documents.
func splitByKind(input string) (istio, kube []string, err error) {
	for i, d := range splitDocs(input) {
		var tm typeMeta
		if err := yaml.Unmarshal([]byte(d), &tm); err != nil {
			return nil, nil, fmt.Errorf("document %d: not a YAML object: %v", i+1, err)
		}
		if tm.APIVersion == "" || tm.Kind == "" {
			return nil, nil, fmt.Errorf("document %d: needs apiVersion and kind", i+1)
		}
		if isIstioConfig(tm.APIVersion) {
			istio = append(istio, d)
		} else {
			kube = append(kube, d)
		}
	}
	return istio, kube, nil
}

func joinDocs(docs []string) string {
	return strings.Join(docs, "\n---\n")
}

// applier makes live changes through the same store and client the fake server watches, so
// every change goes through istiod's own event handlers and pushes (pilot/test/xds/fake.go
// registers configHandler on the store; the Kubernetes controller watches the client).
type applier struct {
	ds *xdsfake.FakeDiscoveryServer
}

// apply creates or updates every object in yaml; with remove, deletes them instead.
// It returns one line per object.
func (a *applier) apply(input string, remove bool) ([]string, error) {
	istioDocs, kubeDocs, err := splitByKind(input)
	if err != nil {
		return nil, err
	}
	var done []string
	if len(istioDocs) > 0 {
		configs, _, err := crd.ParseInputs(joinDocs(istioDocs))
		if err != nil {
			return done, fmt.Errorf("parsing Istio config: %v", err)
		}
		for _, c := range configs {
			line, err := a.applyConfig(c, remove)
			if err != nil {
				return done, err
			}
			done = append(done, line)
		}
	}
	decode := kubelib.IstioCodec.UniversalDeserializer().Decode
	for _, d := range kubeDocs {
		obj, _, err := decode([]byte(d), nil, nil)
		if err != nil {
			return done, fmt.Errorf("decoding Kubernetes object: %v", err)
		}
		line, err := a.applyKube(obj, remove)
		if err != nil {
			return done, err
		}
		done = append(done, line)
	}
	a.waitCommitted(10 * time.Second)
	return done, nil
}

func (a *applier) applyConfig(c config.Config, remove bool) (string, error) {
	if c.Namespace == "" {
		c.Namespace = "default"
	}
	store := a.ds.Store()
	id := fmt.Sprintf("%s %s/%s", c.GroupVersionKind.Kind, c.Namespace, c.Name)
	switch {
	case remove:
		if err := store.Delete(c.GroupVersionKind, c.Name, c.Namespace, nil); err != nil {
			return "", fmt.Errorf("deleting %s: %v", id, err)
		}
		return "deleted " + id, nil
	case store.Get(c.GroupVersionKind, c.Name, c.Namespace) != nil:
		c.ResourceVersion = ""
		if _, err := store.Update(c); err != nil {
			return "", fmt.Errorf("updating %s: %v", id, err)
		}
		return "updated " + id, nil
	default:
		if _, err := store.Create(c); err != nil {
			return "", fmt.Errorf("creating %s: %v", id, err)
		}
		return "created " + id, nil
	}
}

// typedClient is what the typed clientsets offer for one kind.
type typedClient[T runtime.Object] interface {
	Create(ctx context.Context, obj T, opts metav1.CreateOptions) (T, error)
	Update(ctx context.Context, obj T, opts metav1.UpdateOptions) (T, error)
	Delete(ctx context.Context, name string, opts metav1.DeleteOptions) error
}

func upsert[T runtime.Object](c typedClient[T], obj T, name string, remove bool) (string, error) {
	ctx := context.Background()
	if remove {
		return "deleted", c.Delete(ctx, name, metav1.DeleteOptions{})
	}
	_, err := c.Create(ctx, obj, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		_, err = c.Update(ctx, obj, metav1.UpdateOptions{})
		return "updated", err
	}
	return "created", err
}

func (a *applier) applyKube(obj runtime.Object, remove bool) (string, error) {
	kc := a.ds.KubeClient().Kube()
	m, err := metaOf(obj)
	if err != nil {
		return "", err
	}
	if m.GetNamespace() == "" {
		if _, isNs := obj.(*corev1.Namespace); !isNs {
			m.SetNamespace("default")
		}
	}
	ns, name := m.GetNamespace(), m.GetName()
	var verb string
	switch o := obj.(type) {
	case *corev1.Namespace:
		verb, err = upsert(kc.CoreV1().Namespaces(), o, name, remove)
	case *corev1.Service:
		verb, err = upsert(kc.CoreV1().Services(ns), o, name, remove)
	case *corev1.Pod:
		verb, err = upsert(kc.CoreV1().Pods(ns), o, name, remove)
	case *corev1.Node:
		verb, err = upsert(kc.CoreV1().Nodes(), o, name, remove)
	case *corev1.ConfigMap:
		verb, err = upsert(kc.CoreV1().ConfigMaps(ns), o, name, remove)
	case *corev1.Secret:
		verb, err = upsert(kc.CoreV1().Secrets(ns), o, name, remove)
	case *corev1.ServiceAccount:
		verb, err = upsert(kc.CoreV1().ServiceAccounts(ns), o, name, remove)
	case *discoveryv1.EndpointSlice:
		verb, err = upsert(kc.DiscoveryV1().EndpointSlices(ns), o, name, remove)
	default:
		return "", fmt.Errorf("live changes of %T are not supported (Namespace, Service, Pod, Node, ConfigMap, "+
			"Secret, ServiceAccount, EndpointSlice and Istio config are)", obj)
	}
	kind := fmt.Sprintf("%T", obj)
	kind = kind[strings.LastIndex(kind, ".")+1:]
	id := fmt.Sprintf("%s %s/%s", kind, ns, name)
	if err != nil {
		return "", fmt.Errorf("%s: %v", id, err)
	}
	return verb + " " + id, nil
}

func metaOf(obj runtime.Object) (metav1.Object, error) {
	m, ok := obj.(metav1.Object)
	if !ok {
		return nil, fmt.Errorf("%T has no object metadata", obj)
	}
	return m, nil
}

// waitCommitted waits (bounded) until the updates istiod has received so far are committed to
// a push context, as FakeDiscoveryServer.EnsureSynced does, without its t.Fatal on timeout.
// Kubernetes objects reach istiod through informers a moment later; their push follows on its own.
func (a *applier) waitCommitted(limit time.Duration) {
	want := a.ds.Discovery.InboundUpdates.Load()
	deadline := time.Now().Add(limit)
	for a.ds.Discovery.CommittedUpdates.Load() < want && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
}
