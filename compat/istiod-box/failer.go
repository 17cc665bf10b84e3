package main

import (
	"fmt"
	"os"
	"sync"

	"istio.io/istio/pkg/log"
	"istio.io/istio/pkg/test"
)

// processFailer lets a long-running process use Istio's in-process control plane, whose
// constructors take a test.Failer (pkg/test/failer.go) instead of returning errors. Fatal means
// the control plane cannot work: log it and exit non-zero, from whichever goroutine it came.
// Cleanups run in reverse order at shutdown, as testing.T runs them.
type processFailer struct {
	mu       sync.Mutex
	cleanups []func()
	tempDirs []string
}

var _ test.Failer = (*processFailer)(nil)

func (f *processFailer) Fail()                        { f.Fatal("control plane failure") }
func (f *processFailer) FailNow()                     { f.Fatal("control plane failure") }
func (f *processFailer) Helper()                      {}
func (f *processFailer) Log(a ...any)                 { log.Info(fmt.Sprint(a...)) }
func (f *processFailer) Logf(format string, a ...any) { log.Infof(format, a...) }
func (f *processFailer) Skip(a ...any)                { f.Fatal(append([]any{"skip requested: "}, a...)...) }

func (f *processFailer) Fatal(a ...any) {
	fmt.Fprintf(os.Stderr, "istiod-box: fatal: %s\n", fmt.Sprint(a...))
	os.Exit(1)
}

func (f *processFailer) Fatalf(format string, a ...any) {
	f.Fatal(fmt.Sprintf(format, a...))
}

func (f *processFailer) Cleanup(fn func()) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.cleanups = append(f.cleanups, fn)
}

func (f *processFailer) TempDir() string {
	d, err := os.MkdirTemp("", "istiod-box-")
	if err != nil {
		f.Fatalf("temp dir: %v", err)
	}
	f.mu.Lock()
	f.tempDirs = append(f.tempDirs, d)
	f.mu.Unlock()
	return d
}

// shutdown runs the cleanups (last registered first) and removes the temp dirs.
func (f *processFailer) shutdown() {
	f.mu.Lock()
	cleanups := f.cleanups
	f.cleanups = nil
	dirs := f.tempDirs
	f.tempDirs = nil
	f.mu.Unlock()
	for i := len(cleanups) - 1; i >= 0; i-- {
		cleanups[i]()
	}
	for _, d := range dirs {
		_ = os.RemoveAll(d)
	}
}
