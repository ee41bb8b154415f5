package main

import (
	"bufio"
	"context"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// dashboardSeries reads testdata/dcgm-dashboard-series.txt: the metric names NVIDIA's
// Grafana dashboard for dcgm-exporter queries.
func dashboardSeries(t *testing.T) []string {
	t.Helper()
	f, err := os.Open(filepath.Join("testdata", "dcgm-dashboard-series.txt"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var names []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if line := strings.TrimSpace(sc.Text()); line != "" && !strings.HasPrefix(line, "#") {
			names = append(names, line)
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if len(names) != 6 {
		t.Fatalf("the dashboard fixture lists %d series, want its 6: %v", len(names), names)
	}
	return names
}

// labelMap returns m's labels by name.
func labelMap(m *dto.Metric) map[string]string {
	out := make(map[string]string)
	for _, l := range m.GetLabel() {
		out[l.GetName()] = l.GetValue()
	}
	return out
}

// wholeGPUs returns the series of family name in mfs that are whole GPUs' (no GPU_I_ID),
// by their gpu label.
func wholeGPUs(mfs map[string]*dto.MetricFamily, name string) map[string]*dto.Metric {
	out := make(map[string]*dto.Metric)
	for _, m := range mfs[name].GetMetric() {
		if l := labelMap(m); l["GPU_I_ID"] == "" {
			out[l["gpu"]] = m
		}
	}
	return out
}

// instances returns the series of family name in mfs that are GPU instances' of the
// GPU with UUID gpuUUID.
func instances(mfs map[string]*dto.MetricFamily, name, gpuUUID string) []*dto.Metric {
	var out []*dto.Metric
	for _, m := range mfs[name].GetMetric() {
		if l := labelMap(m); l["GPU_I_ID"] != "" && l["UUID"] == gpuUUID {
			out = append(out, m)
		}
	}
	return out
}

// `agent -dev` with on-demand MIG on the simulated DGX H100 serves every series NVIDIA's
// dashboard queries for each of the 8 GPUs, tensor activity included; a reserved MIG
// device's series carry its GPU's labels plus GPU_I_PROFILE and GPU_I_ID, and go when
// it is released.
func TestDevAgentServesTheDCGMDashboard(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the devicehost binary")
	}
	names := dashboardSeries(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	_, client, url := startDevMetricsAgent(t, ctx, "dhdb", "stats_interval = \"100ms\"\nplugin \"nvidia-example\" {\n  config {\n    simulate = \"dgxh100\"\n    mig = \"on-demand\"\n  }\n}\n")
	scraper := &http.Client{Timeout: 20 * time.Second}

	fps, err := client.Fingerprint(ctx, &pb.FingerprintRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var mig *pb.DeviceGroup
	waitFingerprint(t, "the 1g.10gb group", fps, func(fp *pb.FingerprintResponse) bool {
		for _, g := range fp.GetGroups() {
			if g.GetType() == "mig" && g.GetName() == "1g.10gb" && len(g.GetDevices()) == 56 {
				mig = g
			}
		}
		return mig != nil
	})
	dev := mig.GetDevices()[0].GetId()
	gpuUUID, _, ok := strings.Cut(dev, "-mig-")
	if !ok {
		t.Fatalf("MIG device ID %q does not name its GPU", dev)
	}
	res, err := client.Reserve(ctx, &pb.ReserveRequest{OwnerId: "dashboard", Vendor: mig.GetVendor(), Type: mig.GetType(), Name: mig.GetName(), DeviceIds: []string{dev}})
	if err != nil {
		t.Fatalf("Reserve(%s): %v", dev, err)
	}

	// Wait, scrape after scrape, until every dashboard series has the 8 GPUs and the
	// instance's memory, temperature and tensor activity are there: GPM needs two
	// samples, and each sample reaches the agent every 100 ms.
	migNames := []string{"DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"}
	var mfs map[string]*dto.MetricFamily
	complete := func() bool {
		for _, name := range names {
			if len(wholeGPUs(mfs, name)) != 8 {
				return false
			}
		}
		for _, name := range migNames {
			if len(instances(mfs, name, gpuUUID)) != 1 {
				return false
			}
		}
		return true
	}
	for mfs = scrapeFamilies(t, scraper, url); !complete(); mfs = scrapeFamilies(t, scraper, url) {
		select {
		case <-ctx.Done():
			for _, name := range names {
				t.Logf("%s: whole GPUs %d, instances of %s %d", name, len(wholeGPUs(mfs, name)), gpuUUID, len(instances(mfs, name, gpuUUID)))
			}
			t.Fatalf("the dashboard's series %v were not all served", names)
		case <-time.After(50 * time.Millisecond):
		}
	}

	for gpu, m := range wholeGPUs(mfs, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE") {
		if v := m.GetGauge().GetValue(); v < 0 || v > 1 {
			t.Errorf("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{gpu=%q} = %v, want a ratio in [0, 1]", gpu, v)
		}
		if _, ok := labelMap(m)["GPU_I_PROFILE"]; ok {
			t.Errorf("whole GPU %s has a GPU_I_PROFILE label: %v", gpu, labelMap(m))
		}
	}
	var gpuIndex string
	for gpu, m := range wholeGPUs(mfs, "DCGM_FI_DEV_GPU_TEMP") {
		if labelMap(m)["UUID"] == gpuUUID {
			gpuIndex = gpu
		}
	}
	const mem = 10240 // 1g.10gb's MiB in go-nvml's H100
	for _, name := range migNames {
		m := instances(mfs, name, gpuUUID)[0]
		l := labelMap(m)
		want := []string{"GPU_I_ID", "GPU_I_PROFILE", "Hostname", "UUID", "device", "gpu", "modelName", "pci_bus_id"}
		if got := slices.Sorted(maps.Keys(l)); !slices.Equal(got, want) {
			t.Errorf("%s of %s has labels %v, want %v", name, dev, got, want)
		}
		if id, err := strconv.Atoi(l["GPU_I_ID"]); err != nil || id < 0 || l["GPU_I_PROFILE"] != "1g.10gb" ||
			l["gpu"] != gpuIndex || l["device"] != "nvidia"+gpuIndex || l["modelName"] != mig.GetAttributes()["gpu_model"].GetStringValue() {
			t.Errorf("%s of %s: labels %v, want GPU_I_PROFILE 1g.10gb, a GPU_I_ID and GPU %s's gpu, device and model", name, dev, l, gpuIndex)
		}
		v := m.GetGauge().GetValue()
		switch name {
		case "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE":
			if v < 0 || v > 1 {
				t.Errorf("%s of %s = %v, want a ratio in [0, 1]", name, dev, v)
			}
		case "DCGM_FI_DEV_FB_USED":
			if v <= 0 || v > mem {
				t.Errorf("%s of %s = %v, want its own memory in use, within %v MiB", name, dev, v, mem)
			}
		}
	}
	if got := instances(mfs, "DCGM_FI_DEV_GPU_UTIL", gpuUUID); len(got) != 0 {
		t.Errorf("DCGM_FI_DEV_GPU_UTIL has %d series of GPU instances; NVML has no utilization of MIG devices", len(got))
	}

	// Released, its instance is destroyed and its series go.
	if _, err := client.Release(ctx, &pb.ReleaseRequest{Target: &pb.ReleaseRequest_ReservationId{ReservationId: res.GetReservationId()}}); err != nil {
		t.Fatal(err)
	}
	for mfs = scrapeFamilies(t, scraper, url); len(instances(mfs, "DCGM_FI_DEV_FB_USED", gpuUUID)) != 0; mfs = scrapeFamilies(t, scraper, url) {
		select {
		case <-ctx.Done():
			t.Fatalf("the released %s still has series: %v", dev, instances(mfs, "DCGM_FI_DEV_FB_USED", gpuUUID))
		case <-time.After(50 * time.Millisecond):
		}
	}
}
