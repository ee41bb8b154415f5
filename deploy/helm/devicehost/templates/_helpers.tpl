{{/* The name of the release's objects. */}}
{{- define "devicehost.name" -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The labels of every object; the DaemonSet selects its pods by the name label. */}}
{{- define "devicehost.labels" -}}
app.kubernetes.io/name: {{ include "devicehost.name" . }}
{{- end -}}

{{/* Whether the kubelet bridge and the DRA driver run. */}}
{{- define "devicehost.devicePlugin" -}}
{{- if has .Values.mode (list "devicePlugin" "both") }}true{{ end -}}
{{- end -}}
{{- define "devicehost.dra" -}}
{{- if has .Values.mode (list "dra" "both") }}true{{ end -}}
{{- end -}}

{{/* Whether the agent serves metrics to the cluster; refuses the values that cannot
work: TCP metrics need the TLS Secret, a ServiceMonitor the scraper's. */}}
{{- define "devicehost.metrics" -}}
{{- if .Values.metrics.enabled -}}
{{- if not .Values.metrics.tls.secretName -}}
{{- fail "metrics.enabled needs metrics.tls.secretName: the agent serves metrics off loopback only with mutual TLS (a Secret with tls.crt, tls.key and ca.crt)" -}}
{{- end -}}
{{- if and .Values.metrics.serviceMonitor.enabled (not .Values.metrics.serviceMonitor.clientSecretName) -}}
{{- fail "metrics.serviceMonitor.enabled needs metrics.serviceMonitor.clientSecretName: the scraper's client certificate (tls.crt, tls.key, ca.crt)" -}}
{{- end -}}
true
{{- end -}}
{{- end -}}

{{/* Whether the node-status container runs. */}}
{{- define "devicehost.nodeStatus" -}}
{{- if .Values.nodeStatus.enabled }}true{{ end -}}
{{- end -}}

{{/* The pod's service account: the DRA driver's (which the node-status container
shares), the node-status container's alone, or none. */}}
{{- define "devicehost.serviceAccount" -}}
{{- if include "devicehost.dra" . -}}
{{ include "devicehost.name" . }}-dra
{{- else if include "devicehost.nodeStatus" . -}}
{{ include "devicehost.name" . }}-node-status
{{- end -}}
{{- end -}}

{{/* mode must be one of the three; the schema says so too, this names the value. */}}
{{- define "devicehost.checkMode" -}}
{{- if not (has .Values.mode (list "devicePlugin" "dra" "both")) -}}
{{- fail (printf "mode %q: want devicePlugin, dra or both" (toString .Values.mode)) -}}
{{- end -}}
{{- end -}}

{{/* The extended resource the whole-GPU DeviceClass serves ("" for none), after
dra.extendedResourceName: "auto" is nvidia.com/gpu in dra mode and none in both mode. A
name the kubelet bridge serves too (a resource block of kubeletPlugin.config, or
nvidia.com/gpu when it has none) is refused in both mode: one name, one path. */}}
{{- define "devicehost.extendedResourceName" -}}
{{- $name := .Values.dra.extendedResourceName | default "" | toString -}}
{{- if eq $name "auto" -}}
{{- $name = ternary "nvidia.com/gpu" "" (eq .Values.mode "dra") -}}
{{- end -}}
{{- if and $name (eq .Values.mode "both") -}}
{{- $served := list -}}
{{- range regexFindAll "resource\\s+\"[^\"]+\"" .Values.kubeletPlugin.config -1 -}}
{{- $served = append $served (regexReplaceAll "resource\\s+\"([^\"]+)\"" . "${1}") -}}
{{- end -}}
{{- if not $served -}}
{{- $served = list "nvidia.com/gpu" -}}
{{- end -}}
{{- if has $name $served -}}
{{- fail (printf "dra.extendedResourceName %q: in mode both the kubelet bridge serves %s already (kubeletPlugin.config); give DRA another name, or \"\" for none" $name (join ", " $served)) -}}
{{- end -}}
{{- end -}}
{{- $name -}}
{{- end -}}

{{- define "devicehost.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}

{{/* The agent's socket, in the socket hostPath every container mounts at /run/devicehost. */}}
{{- define "devicehost.agentAddress" -}}
unix:///run/devicehost/devicehost.sock
{{- end -}}

{{/* The sockets of the agent's other listeners, each in a directory of its own under
the socket directory, so that a container mounts its own and no other (the
"access" section of docs/configuration.md): the kubelet bridge's, the DRA
driver's, and a read-only one for the node's monitoring. */}}
{{- define "devicehost.bridgeSocketDir" -}}
/run/devicehost/kubelet-plugin
{{- end -}}
{{- define "devicehost.draSocketDir" -}}
/run/devicehost/dra-plugin
{{- end -}}
{{- define "devicehost.readOnlySocketDir" -}}
/run/devicehost/read-only
{{- end -}}

{{/* The DRA driver's directory under the kubelet's plugins directory. */}}
{{- define "devicehost.draPluginDir" -}}
{{ .Values.kubeletDir }}/plugins/{{ .Values.dra.driverName }}
{{- end -}}

{{/* livenessProbe: grpc_health_probe on the socket given as the context's "addr". */}}
{{- define "devicehost.livenessProbe" -}}
exec:
  command: ["grpc_health_probe", "-addr", {{ .addr | quote }}{{ with .service }}, "-service", {{ . | quote }}{{ end }}]
periodSeconds: {{ .probe.periodSeconds }}
timeoutSeconds: {{ .probe.timeoutSeconds }}
failureThreshold: {{ .probe.failureThreshold }}
{{- end -}}

{{/*
The agent's plugin block of the hostdev plugin: one device block per hostdev.devices
entry, in name order.
*/}}
{{- define "devicehost.hostdevPlugin" -}}
plugin "hostdev" {
  config {
    {{- range $name, $d := .Values.hostdev.devices }}
    device {{ $name | quote }} {
      {{- with $d.paths }}
      paths = {{ toJson . }}
      {{- end }}
      {{- with $d.usb }}
      usb {
        vendor  = {{ .vendor | quote }}
        product = {{ .product | quote }}
        {{- with .serial }}
        serial  = {{ . | quote }}
        {{- end }}
      }
      {{- end }}
      {{- with $d.count }}
      count = {{ . }}
      {{- end }}
      {{- with $d.permissions }}
      permissions = {{ . | quote }}
      {{- end }}
    }
    {{- end }}
  }
}
{{- end }}

{{/*
The kubelet bridge's config: kubeletPlugin.config, with a resource block
devicehost.io/<type> for each host device type put before the closing brace of its
kubernetes block when hostdev is enabled.
*/}}
{{- define "devicehost.kubeletConfig" -}}
{{- $config := .Values.kubeletPlugin.config | trim -}}
{{- if .Values.hostdev.enabled -}}
{{- if not (regexMatch "}$" $config) -}}
{{- fail "kubeletPlugin.config must end with the closing brace of its kubernetes block, so that hostdev.enabled can add the host devices' resource blocks" -}}
{{- end -}}
{{- $blocks := "" -}}
{{- range $name, $d := .Values.hostdev.devices -}}
{{- $blocks = printf "%s\n  resource \"devicehost.io/%s\" {\n    vendor = \"hostdev\"\n    type   = %q\n  }\n" $blocks $name $name -}}
{{- end -}}
{{- $config = printf "%s%s}" (trimSuffix "}" $config) $blocks -}}
{{- end -}}
{{- $config -}}
{{- end }}
