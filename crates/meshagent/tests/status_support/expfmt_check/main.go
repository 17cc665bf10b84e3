// expfmt-check parses a Prometheus text exposition (0.0.4) from stdin with the parser
// Prometheus' own Go client libraries use (github.com/prometheus/common/expfmt), with
// legacy (strict) name validation. It rejects a second HELP or TYPE line for a family, TYPE
// after samples, invalid UTF-8 label values and malformed lines. On success it prints one
// line per family, "<name> <TYPE> <samples>", sorted; on failure the parser's error on
// stderr and exit status 1. The status tests run it on the agent's merged scrape.
package main

import (
	"fmt"
	"os"
	"sort"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

func main() {
	p := expfmt.NewTextParser(model.LegacyValidation)
	families, err := p.TextToMetricFamilies(os.Stdin)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	names := make([]string, 0, len(families))
	for n := range families {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		mf := families[n]
		fmt.Printf("%s %s %d\n", n, mf.GetType().String(), len(mf.GetMetric()))
	}
}
