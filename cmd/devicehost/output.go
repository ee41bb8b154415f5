package main

import (
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// table writes aligned columns; rows are tab-separated.
type table struct {
	tw *tabwriter.Writer
}

func newTable(w io.Writer, header ...string) *table {
	t := &table{tw: tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)}
	t.row(header...)
	return t
}

func (t *table) row(cols ...string) {
	for i, c := range cols {
		if c == "" {
			cols[i] = "-"
		}
	}
	fmt.Fprintln(t.tw, strings.Join(cols, "\t"))
}

func (t *table) flush() error { return t.tw.Flush() }

// printJSON writes m as indented protojson (the API's own JSON mapping).
func printJSON(w io.Writer, m proto.Message) error {
	data, err := protojson.MarshalOptions{Multiline: true, Indent: "  "}.Marshal(m)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(w, "%s\n", data)
	return err
}

// printJSONLine writes m as one line of protojson.
func printJSONLine(w io.Writer, m proto.Message) error {
	data, err := protojson.Marshal(m)
	if err != nil {
		return err
	}
	// protojson may add spaces at random to keep people from depending on its layout;
	// the line is still one line of valid JSON.
	_, err = fmt.Fprintf(w, "%s\n", data)
	return err
}

func groupName(vendor, typ, name string) string { return vendor + "/" + typ + "/" + name }

func healthName(h pb.Health) string {
	switch h {
	case pb.Health_HEALTH_HEALTHY:
		return "healthy"
	case pb.Health_HEALTH_UNHEALTHY:
		return "unhealthy"
	default:
		return "unknown"
	}
}

func pluginStatusName(s pb.PluginStatus) string {
	return strings.ToLower(strings.TrimPrefix(s.String(), "PLUGIN_STATUS_"))
}

func reservationStateName(s pb.ReservationState) string {
	return strings.ToLower(strings.TrimPrefix(s.String(), "RESERVATION_STATE_"))
}

// formatValue renders a value with its unit: "42 %", "81559 MiB", "true".
func formatValue(v *pb.Value) string {
	var s string
	switch k := v.GetKind().(type) {
	case *pb.Value_IntValue:
		s = strconv.FormatInt(k.IntValue, 10)
	case *pb.Value_FloatValue:
		f := k.FloatValue
		if math.Abs(f) >= 1e6 {
			s = strconv.FormatFloat(f, 'f', 0, 64)
		} else {
			s = strconv.FormatFloat(math.Round(f*100)/100, 'f', -1, 64)
		}
	case *pb.Value_StringValue:
		s = k.StringValue
	case *pb.Value_BoolValue:
		s = strconv.FormatBool(k.BoolValue)
	default:
		return ""
	}
	if u := v.GetUnit(); u != "" && u != "count" {
		s += " " + u
	}
	return s
}

// formatTime renders a timestamp in local time, or "" when unset.
func formatTime(ts *timestamppb.Timestamp) string {
	if ts == nil {
		return ""
	}
	return ts.AsTime().Local().Format(time.DateTime)
}
