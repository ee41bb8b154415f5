package logtest_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/devicehost/devicehost/tools/logtest"
)

func TestRecorderWaitSeesALineWrittenLater(t *testing.T) {
	var rec logtest.Recorder
	log := hclog.New(&hclog.LoggerOptions{Output: &rec, Level: hclog.Debug, JSONFormat: true})
	log.Info("first")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	got := make(chan string, 1)
	go func() {
		l, _ := rec.Wait(ctx, logtest.Containing(`"second"`, `"n":2`))
		got <- l
	}()
	log.Info("second", "n", 2)
	if l := <-got; !strings.Contains(l, `"@message":"second"`) {
		t.Errorf("Wait = %q, want the second line", l)
	}
	lines, err := rec.JSON()
	if err != nil || len(lines) != 2 || lines[0]["@message"] != "first" {
		t.Errorf("JSON = %v, %v; want the two lines, first first", lines, err)
	}
	if n := rec.Count(`"@level":"info"`); n != 2 {
		t.Errorf("Count of info lines = %d, want 2", n)
	}
}

func TestRecorderWaitEndsWithItsContext(t *testing.T) {
	var rec logtest.Recorder
	rec.Write([]byte("a line\n"))
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := rec.Wait(ctx, logtest.Containing("another")); !errors.Is(err, context.Canceled) {
		t.Errorf("Wait on an ended context = %v, want context.Canceled", err)
	}
}

func TestRecorderConsumeKeepsLines(t *testing.T) {
	var rec logtest.Recorder
	rec.Consume(strings.NewReader("one\ntwo\n\nthree"))
	if got, want := strings.Join(rec.Lines(), "|"), "one|two|three"; got != want {
		t.Errorf("Lines = %q, want %q", got, want)
	}
}
