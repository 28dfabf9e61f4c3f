// Command floor is the cheapest scheduler extender that speaks the same wire as vramguard's: mutual
// TLS, HTTP/1.1, JSON, the filter, prioritize, bind and preempt verbs. It checks nothing: filter
// passes every node, prioritize scores every node 0, bind creates the Binding, preempt accepts the
// scheduler's victims. The throughput benchmark runs it in place of the vramguard extender
// (`python -m bench.extender --only throughput --extender floor`) to measure what the extender
// protocol alone costs a scheduling wave, whatever the extender does.
//
// It takes the command line the e2e harness gives vramguard (`floor [--http2] extender --listen ADDR
// --tls-cert F --tls-key F --client-ca F --kubeconfig F --ops-listen ADDR [--policy F]`) and serves
// /healthz, /readyz and the request counters the benchmark reads on the ops listener. With
// --http2 it offers HTTP/2 as well (`--extender floor-h2`): kube-scheduler then carries every call
// on one connection, which vramguard's extender (aiohttp, HTTP/1.1) cannot offer.
package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"sigs.k8s.io/yaml"
)

// kubeconfig holds the fields of a one-cluster, token-user kubeconfig that the floor reads.
type kubeconfig struct {
	Clusters []struct {
		Cluster struct {
			Server                   string `json:"server"`
			CertificateAuthorityData string `json:"certificate-authority-data"`
		} `json:"cluster"`
	} `json:"clusters"`
	Users []struct {
		User struct {
			Token string `json:"token"`
		} `json:"user"`
	} `json:"users"`
}

// api creates Bindings on the API server.
type api struct {
	server string
	token  string
	client *http.Client
}

func newAPI(path string) (*api, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var config kubeconfig
	if err := yaml.Unmarshal(raw, &config); err != nil {
		return nil, fmt.Errorf("kubeconfig %s: %w", path, err)
	}
	if len(config.Clusters) != 1 || len(config.Users) != 1 {
		return nil, fmt.Errorf("kubeconfig %s: want one cluster and one user", path)
	}
	caPEM, err := base64.StdEncoding.DecodeString(config.Clusters[0].Cluster.CertificateAuthorityData)
	if err != nil {
		return nil, fmt.Errorf("kubeconfig %s: certificate-authority-data: %w", path, err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(caPEM) {
		return nil, fmt.Errorf("kubeconfig %s: no certificate in certificate-authority-data", path)
	}
	transport := &http.Transport{
		TLSClientConfig:     &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12},
		ForceAttemptHTTP2:   true,
		MaxIdleConnsPerHost: 100,
		IdleConnTimeout:     90 * time.Second,
	}
	return &api{
		server: strings.TrimRight(config.Clusters[0].Cluster.Server, "/"),
		token:  config.Users[0].User.Token,
		client: &http.Client{Transport: transport, Timeout: 30 * time.Second},
	}, nil
}

type bindingArgs struct {
	PodName      string
	PodNamespace string
	PodUID       string
	Node         string
}

func (a *api) bind(args bindingArgs) error {
	body, err := json.Marshal(map[string]any{
		"apiVersion": "v1",
		"kind":       "Binding",
		"metadata":   map[string]any{"name": args.PodName, "namespace": args.PodNamespace, "uid": args.PodUID},
		"target":     map[string]any{"apiVersion": "v1", "kind": "Node", "name": args.Node},
	})
	if err != nil {
		return err
	}
	url := fmt.Sprintf("%s/api/v1/namespaces/%s/pods/%s/binding", a.server, args.PodNamespace, args.PodName)
	request, err := http.NewRequest(http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return err
	}
	request.Header.Set("Authorization", "Bearer "+a.token)
	request.Header.Set("Content-Type", "application/json")
	request.Header.Set("Accept", "application/json")
	response, err := a.client.Do(request)
	if err != nil {
		return err
	}
	defer response.Body.Close()
	answer, _ := io.ReadAll(io.LimitReader(response.Body, 64<<10))
	if response.StatusCode != http.StatusCreated && response.StatusCode != http.StatusOK {
		return fmt.Errorf("binding %s/%s: %s: %s", args.PodNamespace, args.PodName, response.Status, answer)
	}
	return nil
}

// counters are what the benchmark reads of an extender: per route, the requests, the seconds spent
// answering them and the TLS connections whose first request it was.
type counters struct {
	mu          sync.Mutex
	requests    map[string]float64
	seconds     map[string]float64
	connections map[string]float64
}

type firstRequest struct{ seen atomic.Bool }

type connKey struct{}

func (c *counters) observe(route string, started time.Time, first bool) {
	elapsed := time.Since(started).Seconds()
	c.mu.Lock()
	defer c.mu.Unlock()
	c.requests[route]++
	c.seconds[route] += elapsed
	if first {
		c.connections[route]++
	}
}

func (c *counters) exposition() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out strings.Builder
	for route, count := range c.requests {
		fmt.Fprintf(&out, "floor_http_request_duration_seconds_sum{route=%q} %g\n", route, c.seconds[route])
		fmt.Fprintf(&out, "floor_http_request_duration_seconds_count{route=%q} %g\n", route, count)
	}
	for route, count := range c.connections {
		fmt.Fprintf(&out, "floor_http_connections_total{route=%q} %g\n", route, count)
	}
	return out.String()
}

const maxBody = 8 << 20

// verb answers one extender verb: its JSON body decoded into In, the answer encoded as JSON.
func verb[In any](stats *counters, answer func(In) any) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		started := time.Now()
		first := false
		if marker, ok := r.Context().Value(connKey{}).(*firstRequest); ok {
			first = marker.seen.CompareAndSwap(false, true)
		}
		defer func() { stats.observe(r.URL.Path, started, first) }()
		var args In
		if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxBody)).Decode(&args); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		if err := json.NewEncoder(w).Encode(answer(args)); err != nil {
			log.Printf("%s: %v", r.URL.Path, err)
		}
	}
}

type extenderArgs struct {
	Pod       json.RawMessage
	NodeNames []string
}

type hostPriority struct {
	Host  string
	Score int64
}

type preemptionArgs struct {
	NodeNameToMetaVictims map[string]json.RawMessage
}

func routes(stats *counters, cluster *api) *http.ServeMux {
	mux := http.NewServeMux()
	mux.Handle("POST /filter", verb(stats, func(args extenderArgs) any {
		return map[string]any{"NodeNames": args.NodeNames, "FailedNodes": map[string]string{}, "Error": ""}
	}))
	mux.Handle("POST /prioritize", verb(stats, func(args extenderArgs) any {
		scores := make([]hostPriority, len(args.NodeNames))
		for i, name := range args.NodeNames {
			scores[i] = hostPriority{Host: name}
		}
		return scores
	}))
	mux.Handle("POST /bind", verb(stats, func(args bindingArgs) any {
		if err := cluster.bind(args); err != nil {
			return map[string]string{"Error": err.Error()}
		}
		return map[string]string{"Error": ""}
	}))
	mux.Handle("POST /preempt", verb(stats, func(args preemptionArgs) any {
		return map[string]any{"NodeNameToMetaVictims": args.NodeNameToMetaVictims}
	}))
	return mux
}

func operational(stats *counters) *http.ServeMux {
	mux := http.NewServeMux()
	ok := func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok\n") }
	mux.HandleFunc("GET /healthz", ok)
	mux.HandleFunc("GET /readyz", ok)
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4")
		_, _ = io.WriteString(w, stats.exposition())
	})
	return mux
}

func serverTLS(certFile, keyFile, clientCA string) (*tls.Config, error) {
	pair, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, err
	}
	pem, err := os.ReadFile(clientCA)
	if err != nil {
		return nil, err
	}
	clients := x509.NewCertPool()
	if !clients.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("%s: no certificate", clientCA)
	}
	return &tls.Config{
		Certificates: []tls.Certificate{pair},
		ClientCAs:    clients,
		ClientAuth:   tls.RequireAndVerifyClientCert,
		MinVersion:   tls.VersionTLS12,
	}, nil
}

const usage = "usage: floor [--http2] extender --listen ADDR --tls-cert F --tls-key F --client-ca F --kubeconfig F --ops-listen ADDR"

// run serves the verbs; http2 offers HTTP/2 too (one multiplexed connection from kube-scheduler,
// as any Go extender gets by default), otherwise HTTP/1.1 only, as vramguard's extender.
func run(args []string, http2 bool) error {
	if len(args) == 0 || args[0] != "extender" {
		return errors.New(usage)
	}
	flags := flag.NewFlagSet("floor extender", flag.ContinueOnError)
	listen := flags.String("listen", "127.0.0.1:8443", "address of the verbs (mutual TLS)")
	certFile := flags.String("tls-cert", "", "serving certificate")
	keyFile := flags.String("tls-key", "", "serving key")
	clientCA := flags.String("client-ca", "", "CA of the client certificates to accept")
	kubeconfigPath := flags.String("kubeconfig", "", "kubeconfig of the identity that creates Bindings")
	opsListen := flags.String("ops-listen", "127.0.0.1:8080", "address of /healthz, /readyz and /metrics (plain HTTP)")
	flags.String("policy", "", "ignored: the floor checks nothing")
	if err := flags.Parse(args[1:]); err != nil {
		return err
	}
	if *certFile == "" || *keyFile == "" || *clientCA == "" || *kubeconfigPath == "" {
		return errors.New("--tls-cert, --tls-key, --client-ca and --kubeconfig are required")
	}
	config, err := serverTLS(*certFile, *keyFile, *clientCA)
	if err != nil {
		return err
	}
	cluster, err := newAPI(*kubeconfigPath)
	if err != nil {
		return err
	}
	stats := &counters{requests: map[string]float64{}, seconds: map[string]float64{}, connections: map[string]float64{}}
	verbs := &http.Server{
		Addr:              *listen,
		Handler:           routes(stats, cluster),
		TLSConfig:         config,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       90 * time.Second,
		ConnContext: func(ctx context.Context, _ net.Conn) context.Context {
			return context.WithValue(ctx, connKey{}, &firstRequest{})
		},
	}
	if !http2 {
		// A non-nil, empty TLSNextProto turns HTTP/2 off.
		verbs.TLSNextProto = map[string]func(*http.Server, *tls.Conn, http.Handler){}
	}
	ops := &http.Server{Addr: *opsListen, Handler: operational(stats), ReadHeaderTimeout: 10 * time.Second}
	failed := make(chan error, 2)
	go func() { failed <- ops.ListenAndServe() }()
	go func() { failed <- verbs.ListenAndServeTLS("", "") }()
	return <-failed
}

func main() {
	args := os.Args[1:]
	http2 := len(args) > 0 && args[0] == "--http2"
	if http2 {
		args = args[1:]
	}
	if len(args) == 2 && args[1] == "--help" {
		if args[0] == "extender" {
			fmt.Println("floor extender: the cheapest extender over vramguard's wire (see the source)")
			return
		}
		os.Exit(2) // only the extender: the harness starts no webhook
	}
	if err := run(args, http2); err != nil {
		log.Fatal(err)
	}
}
