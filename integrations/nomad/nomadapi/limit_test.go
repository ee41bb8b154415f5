package nomadapi

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// An answer longer than the response limit is an error, never a partial answer; one of
// exactly the limit is read.
func TestResponseLimit(t *testing.T) {
	one := `{"ID":"x","Job":{"Payload":"` + strings.Repeat("a", 200) + `"}}`
	for _, tc := range []struct {
		name  string
		body  string
		limit int64
		want  string // "" for success
	}{
		{"over", "[" + one + "," + one + "]", int64(len(one)) + 10, "answer larger than"},
		{"exactly", "[" + one + "]", int64(len(one)) + 2, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
				_, _ = w.Write([]byte(tc.body))
			}))
			defer srv.Close()
			c, err := New(Config{Address: srv.URL})
			if err != nil {
				t.Fatal(err)
			}
			defer c.CloseIdleConnections()
			c.maxBytes = tc.limit
			allocs, _, err := c.NodeAllocations(context.Background(), "n", Query{})
			switch {
			case tc.want == "" && (err != nil || len(allocs) != 1):
				t.Errorf("got %v, %v; want one allocation", allocs, err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Errorf("got %v, %v; want an error %q", allocs, err, tc.want)
			}
		})
	}
}
