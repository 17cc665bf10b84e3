package main

import (
	"crypto"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"math/big"
	"os"
	"path/filepath"
	"time"
)

// tokenIssuer signs Kubernetes-style service account tokens (RS256, the algorithm go-oidc's
// verifier accepts by default) that Istio's JWT authenticator
// (security/pkg/server/ca/authenticate/oidc.go) verifies against the JWKS served here: `iss` is
// this box's HTTP address, `aud` is "istio-ca", `sub` is system:serviceaccount:NS:SA.
type tokenIssuer struct {
	key      *rsa.PrivateKey
	kid      string
	issuer   string
	audience string
}

func newTokenIssuer(issuer, audience string) (*tokenIssuer, error) {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return nil, fmt.Errorf("generating the token signing key: %v", err)
	}
	return &tokenIssuer{key: key, kid: "istiod-box", issuer: issuer, audience: audience}, nil
}

func b64(b []byte) string { return base64.RawURLEncoding.EncodeToString(b) }

// jwks is the JSON Web Key Set with the one verification key.
func (t *tokenIssuer) jwks() []byte {
	pub := t.key.PublicKey
	out, _ := json.Marshal(map[string]any{"keys": []map[string]string{{
		"kty": "RSA", "use": "sig", "alg": "RS256", "kid": t.kid,
		"n": b64(pub.N.Bytes()), "e": b64(big.NewInt(int64(pub.E)).Bytes()),
	}}})
	return out
}

// token signs a token for namespace/serviceAccount valid for ttl.
func (t *tokenIssuer) token(namespace, serviceAccount string, ttl time.Duration) (string, error) {
	if namespace == "" || serviceAccount == "" {
		return "", fmt.Errorf("a token needs both a namespace and a service account (got %q, %q)", namespace, serviceAccount)
	}
	now := time.Now()
	header, _ := json.Marshal(map[string]string{"alg": "RS256", "typ": "JWT", "kid": t.kid})
	claims, _ := json.Marshal(map[string]any{
		"iss": t.issuer,
		"aud": []string{t.audience},
		"sub": "system:serviceaccount:" + namespace + ":" + serviceAccount,
		"iat": now.Unix(),
		"nbf": now.Unix(),
		"exp": now.Add(ttl).Unix(),
		// What a projected token of a pod carries (pilot-agent only reads sub/aud/exp).
		"kubernetes.io": map[string]any{
			"namespace":      namespace,
			"serviceaccount": map[string]string{"name": serviceAccount},
		},
	})
	signingInput := b64(header) + "." + b64(claims)
	digest := sha256.Sum256([]byte(signingInput))
	sig, err := rsa.SignPKCS1v15(rand.Reader, t.key, crypto.SHA256, digest[:])
	if err != nil {
		return "", fmt.Errorf("signing the token: %v", err)
	}
	return signingInput + "." + b64(sig), nil
}

// Paths of a pod's projected token and istiod root, relative to an agent's working directory
// (pilot-agent reads both relative to its cwd: pkg/istio-agent and pilot/cmd/pilot-agent/options).
const (
	tokenRelPath = "var/run/secrets/tokens/istio-token"
	rootRelPath  = "var/run/secrets/istio/root-cert.pem"
)

// writePodSecrets writes the token and the root certificate where an agent running in dir
// reads them.
func writePodSecrets(dir, token string, rootPEM []byte) error {
	if err := writeFile(filepath.Join(dir, tokenRelPath), []byte(token)); err != nil {
		return err
	}
	return writeFile(filepath.Join(dir, rootRelPath), rootPEM)
}

// writeFile writes atomically (temp file + rename) so a watching agent never reads half a file.
func writeFile(path string, data []byte) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return fmt.Errorf("creating %s: %v", filepath.Dir(path), err)
	}
	tmp := path + ".tmp~"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return fmt.Errorf("writing %s: %v", tmp, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("renaming %s to %s: %v", tmp, path, err)
	}
	return nil
}
