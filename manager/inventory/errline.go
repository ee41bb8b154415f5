package inventory

import "github.com/devicehost/devicehost/textline"

// MaxErrorLen bounds, in bytes, what the registry keeps of an error as a plugin's last
// error or a device's health reason: both reach every ListPlugins answer, and the last
// error every UNAVAILABLE answer naming the plugin, and the log line of each such call.
// The manager bounds the plugin errors it returns to callers alike.
const MaxErrorLen = 300

// ErrorLine renders s as the registry keeps an error (see textline.Line): one printable
// line, lines joined with "; ", at most MaxErrorLen bytes.
func ErrorLine(s string) string { return textline.Line(s, MaxErrorLen) }
