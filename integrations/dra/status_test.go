package dra

import (
	"context"
	"encoding/json"
	"fmt"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	k8stesting "k8s.io/client-go/testing"

	"github.com/devicehost/devicehost/tools/testwait"
)

// claimDeviceStatus is a claim's status.devices, as statusOf says them.
func (r *rig) claimDeviceStatus(t *testing.T, ns, name string) []string {
	t.Helper()
	c, err := r.kube.ResourceV1().ResourceClaims(ns).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return statusOf(t, c)
}

// statusOf is c's status.devices as "driver/pool/device Ready= Healthy= uuid= type= cdi=".
func statusOf(t *testing.T, c *resourceapi.ResourceClaim) []string {
	t.Helper()
	var out []string
	for _, d := range c.Status.Devices {
		cond := map[string]string{}
		for _, c := range d.Conditions {
			cond[c.Type] = string(c.Status)
		}
		var data deviceStatusData
		if d.Data != nil {
			if err := json.Unmarshal(d.Data.Raw, &data); err != nil {
				t.Fatalf("device %s: data %s: %v", d.Device, d.Data.Raw, err)
			}
		}
		out = append(out, fmt.Sprintf("%s/%s/%s Ready=%s Healthy=%s uuid=%s type=%s cdi=%d",
			d.Driver, d.Pool, d.Device, cond["Ready"], cond["Healthy"], data.UUID, data.Type, len(data.CDIDeviceIDs)))
	}
	return out
}

// After Prepare the claim's status names each of its devices, Ready, with its health
// and UUID; the health follows the device's; Unprepare removes the entries.
func TestClaimDeviceStatus(t *testing.T) {
	r := newRig(t)
	r.startDriver(nil)
	k := r.kubelet()
	ids, _ := r.waitGPUs()
	c := r.claim("pair", DeviceName(ids[2]), DeviceName(ids[5]))
	if p := k.prepare(t, c); p.GetError() != "" {
		t.Fatalf("prepare: %s", p.GetError())
	}
	want := func(healthy string) []string {
		var out []string
		for _, id := range []string{ids[2], ids[5]} {
			out = append(out, fmt.Sprintf("%s/%s/%s Ready=True Healthy=%s uuid=%s type=gpu cdi=2", testDriver, testNode, DeviceName(id), healthy, id))
		}
		return out
	}
	// Every stored version of the claim is looked at (a watch), so a state that lasts
	// only a moment (the plugin down before its restart) is seen too.
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Timeout)
	defer cancel()
	w, err := r.kube.ResourceV1().ResourceClaims(c.Namespace).Watch(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	last := r.claimDeviceStatus(t, c.Namespace, c.Name)
	waitStatus := func(what string, want []string) {
		t.Helper()
		for fmt.Sprint(last) != fmt.Sprint(want) {
			select {
			case ev, ok := <-w.ResultChan():
				if !ok {
					t.Fatalf("%s: the watch ended", what)
				}
				if obj, ok := ev.Object.(*resourceapi.ResourceClaim); ok && obj.Name == c.Name {
					last = statusOf(t, obj)
				}
			case <-ctx.Done():
				t.Fatalf("%s: claim status %q, want %q", what, last, want)
			}
		}
	}
	waitStatus("prepared", want("True"))

	for _, pid := range pluginPIDs(r.agent) {
		syscall.Kill(pid, syscall.SIGKILL)
	}
	waitStatus("the plugin killed", want("False"))
	waitStatus("the plugin back", want("True"))

	if e := k.unprepare(t, c); e != "" {
		t.Fatalf("unprepare: %s", e)
	}
	waitStatus("unprepared", nil)
}

// A status the API server refuses is written again later, and the prepare's answer
// never waited on it: the claim is prepared while its status write fails.
func TestClaimDeviceStatusRetried(t *testing.T) {
	old := statusRetry
	statusRetry = 50 * time.Millisecond
	t.Cleanup(func() { statusRetry = old })
	r := newRig(t)
	var refused atomic.Int64
	r.kube.PrependReactor("patch", "resourceclaims", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.GetSubresource() == "status" && refused.Add(1) <= 3 {
			return true, nil, apierrors.NewServiceUnavailable("e2e: the API server is busy")
		}
		return false, nil, nil
	})
	r.startDriver(nil)
	k := r.kubelet()
	ids, _ := r.waitGPUs()
	c := r.claim("retried", DeviceName(ids[1]))
	if p := k.prepare(t, c); p.GetError() != "" || len(p.GetDevices()) != 1 {
		t.Fatalf("prepare while status writes fail: %s %v", p.GetError(), p.GetDevices())
	}
	want := fmt.Sprintf("[%s/%s/%s Ready=True Healthy=True uuid=%s type=gpu cdi=2]", testDriver, testNode, DeviceName(ids[1]), ids[1])
	deadline := time.Now().Add(testwait.Timeout)
	for got := fmt.Sprint(r.claimDeviceStatus(t, c.Namespace, c.Name)); got != want; got = fmt.Sprint(r.claimDeviceStatus(t, c.Namespace, c.Name)) {
		if time.Now().After(deadline) {
			t.Fatalf("claim status %s after %d refused writes, want %s", got, refused.Load(), want)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if n := refused.Load(); n < 4 {
		t.Errorf("%d status writes, want the 3 refused and one more", n)
	}
}
