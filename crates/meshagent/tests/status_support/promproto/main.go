// promproto: the Prometheus Go client on both ends of a protobuf scrape, for the agent's
// metrics-merge tests.
//
//	promproto serve PORT   an application exposing, through client_golang's promhttp (which
//	                       answers protobuf when asked), a native histogram, a classic one and
//	                       a counter on 127.0.0.1:PORT/metrics
//	promproto parse        reads a delimited protobuf exposition (io.prometheus.client.MetricFamily)
//	                       on stdin with prometheus/common's decoder and prints one line per
//	                       family: NAME TYPE SERIES NATIVE, NATIVE being how many histogram
//	                       series carry native buckets; exits 1 on a decoding error or a family
//	                       name seen twice
package main

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
)

func serve(port string) error {
	reg := prometheus.NewRegistry()
	native := prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:                        "app_native_seconds",
		Help:                        "A native histogram.",
		NativeHistogramBucketFactor: 1.1,
	})
	classic := prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "app_classic_seconds",
		Help:    "A classic histogram.",
		Buckets: []float64{0.1, 1},
	})
	counter := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "app_requests_total",
		Help: "Requests.",
	}, []string{"code"})
	reg.MustRegister(native, classic, counter)
	for _, v := range []float64{0.001, 0.01, 0.02, 0.3, 1.5, 7} {
		native.Observe(v)
		classic.Observe(v)
	}
	counter.WithLabelValues("200").Add(7)
	http.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	return http.ListenAndServe("127.0.0.1:"+port, nil)
}

func parse() error {
	dec := expfmt.NewDecoder(os.Stdin, expfmt.NewFormat(expfmt.TypeProtoDelim))
	seen := map[string]bool{}
	for {
		var mf dto.MetricFamily
		if err := dec.Decode(&mf); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		if seen[mf.GetName()] {
			return fmt.Errorf("family %s twice", mf.GetName())
		}
		seen[mf.GetName()] = true
		native := 0
		for _, m := range mf.GetMetric() {
			h := m.GetHistogram()
			if h != nil && (h.Schema != nil || len(h.GetPositiveSpan()) > 0 || h.ZeroThreshold != nil) {
				native++
			}
		}
		fmt.Printf("%s %s %d %d\n", mf.GetName(), mf.GetType(), len(mf.GetMetric()), native)
	}
}

func main() {
	var err error
	switch {
	case len(os.Args) == 3 && os.Args[1] == "serve":
		err = serve(os.Args[2])
	case len(os.Args) == 2 && os.Args[1] == "parse":
		err = parse()
	default:
		err = errors.New("usage: promproto serve PORT | promproto parse")
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
