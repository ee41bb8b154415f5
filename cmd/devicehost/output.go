package main

import (
	"bytes"
	"encoding/json"
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
	"github.com/devicehost/devicehost/textline"
)

// table writes aligned columns, separated by at least two spaces. Every cell goes
// through cell, so no value (an owner ID, a health reason, a plugin's error) can make
// a row look like more columns or more rows than it is.
type table struct {
	tw *tabwriter.Writer
}

func newTable(w io.Writer, header ...string) *table {
	t := &table{tw: tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)}
	t.row(header...)
	return t
}

// newTableNoHeader is a table without a header row: the next rows of one already shown.
func newTableNoHeader(w io.Writer) *table {
	return &table{tw: tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)}
}

// row adds a row of raw values, each escaped with cell.
func (t *table) row(cols ...string) {
	out := make([]string, len(cols))
	for i, c := range cols {
		out[i] = cell(c)
	}
	t.rowEscaped(out...)
}

// rowEscaped adds a row whose cells are already escaped (built from cell's results).
func (t *table) rowEscaped(cols ...string) {
	fmt.Fprintln(t.tw, strings.Join(cols, "\t"))
}

// cell renders a value for a table cell: "-" for an empty one, and Go-quoted (with
// escapes such as \n, \t, \x1b, \u00a0) when it could be misread: a run of spaces or a
// leading or trailing space (columns are two spaces apart), a character that is not
// printable (a newline would start a fake row; a terminal escape could rewrite the
// screen), invalid UTF-8, a leading quote, or the text "-" itself.
func cell(s string) string {
	if s == "" {
		return "-"
	}
	if s == "-" || strings.Contains(s, "  ") || s[0] == ' ' || s[0] == '"' || s[len(s)-1] == ' ' ||
		!textline.Printable(s) {
		return strconv.Quote(s)
	}
	return s
}

func (t *table) flush() error { return t.tw.Flush() }

// printJSON writes m in the API's own JSON mapping (protojson), indented by two spaces
// per level as encoding/json indents. protojson adds spaces at random to keep people
// from depending on its layout (`"id":  "x"`), so its output is laid out again (see
// layoutJSON): the same message always prints the same bytes.
func printJSON(w io.Writer, m proto.Message) error { return writeJSON(w, m, true) }

// printJSONLine writes m as one line of compact protojson, stable as printJSON's.
func printJSONLine(w io.Writer, m proto.Message) error { return writeJSON(w, m, false) }

func writeJSON(w io.Writer, m proto.Message, indent bool) error {
	data, err := protojson.Marshal(m)
	if err != nil {
		return err
	}
	if data, err = layoutJSON(data, indent); err != nil {
		return err
	}
	_, err = w.Write(data)
	return err
}

// layoutJSON drops the insignificant spaces of data, valid JSON, and returns it compact
// or, with indent, indented by two spaces per level; either way with a newline.
func layoutJSON(data []byte, indent bool) ([]byte, error) {
	var buf bytes.Buffer
	var err error
	if indent {
		err = json.Indent(&buf, data, "", "  ")
	} else {
		err = json.Compact(&buf, data)
	}
	if err != nil {
		return nil, err
	}
	buf.WriteByte('\n')
	return buf.Bytes(), nil
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
