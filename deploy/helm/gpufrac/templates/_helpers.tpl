{{/*
The labels every object carries: the same app.kubernetes.io/* set as the kustomize
base (no helm.sh/chart or managed-by), so both installs produce identical objects
and selectors; commonLabels adds the operator's own.
*/}}
{{- define "gpufrac.labels" -}}
app.kubernetes.io/name: gpufrac
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
app.kubernetes.io/part-of: gpufrac
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The node config as a dict: the shipped file with .Values.config merged over it. */}}
{{- define "gpufrac.config" -}}
{{- $cfg := .Files.Get "files/config.yaml" | fromYaml -}}
{{- toYaml (mergeOverwrite $cfg (deepCopy .Values.config)) -}}
{{- end }}

{{/* The ConfigMap's config.yaml: the shipped file verbatim (comments and all) unless overridden. */}}
{{- define "gpufrac.configText" -}}
{{- if .Values.config -}}
{{- include "gpufrac.config" . }}
{{ else -}}
{{- .Files.Get "files/config.yaml" -}}
{{- end -}}
{{- end }}

{{/*
gpufrac-config-<hash>, computed the way kustomize's configMapGenerator does
(sha256 of the JSON of kind, an empty name and data; 10 hex digits with 0,1,3,a,e
mapped to g,h,k,m,t), so the name matches the kustomize base for the same content
and a changed config rolls the agents.
*/}}
{{- define "gpufrac.configName" -}}
{{- include "gpufrac.hashedName" (dict "name" "gpufrac-config" "text" (include "gpufrac.configText" .)) -}}
{{- end }}

{{/* gpufrac-config-dra-<hash>: DRA mode's config overlay (files/dra-config.yaml, deploy/dra/config.yaml). */}}
{{- define "gpufrac.draConfigName" -}}
{{- include "gpufrac.hashedName" (dict "name" "gpufrac-config-dra" "text" (.Files.Get "files/dra-config.yaml")) -}}
{{- end }}

{{/* <name>-<hash> of a ConfigMap holding config.yaml = .text, as kustomize names it. */}}
{{- define "gpufrac.hashedName" -}}
{{- $enc := dict "data" (dict "config.yaml" .text) "kind" "ConfigMap" "name" "" | toJson -}}
{{- $hash := $enc | sha256sum | trunc 10 | replace "0" "g" | replace "1" "h" | replace "3" "k" | replace "a" "m" | replace "e" "t" -}}
{{ .name }}-{{ $hash }}
{{- end }}

{{/*
The agent pods' affinity: .Values.affinity, and with dra.enabled the device-plugin DaemonSet's
kept off the nodes in DRA mode (gpufrac.dev/mode NotIn [dra], added to each of its required
node selector terms), as deploy/dra/device-plugin-affinity.yaml does. (dict "root" . "dra" bool)
*/}}
{{- define "gpufrac.affinity" -}}
{{- $aff := deepCopy (.root.Values.affinity | default dict) -}}
{{- if and .root.Values.dra.enabled (not .dra) -}}
{{- $expr := dict "key" "gpufrac.dev/mode" "operator" "NotIn" "values" (list "dra") -}}
{{- $na := get $aff "nodeAffinity" | default dict -}}
{{- $req := get $na "requiredDuringSchedulingIgnoredDuringExecution" | default dict -}}
{{- $terms := get $req "nodeSelectorTerms" | default (list dict) -}}
{{- $new := list -}}
{{- range $terms -}}
{{- $t := deepCopy . -}}
{{- $_ := set $t "matchExpressions" (append (get $t "matchExpressions" | default list) $expr) -}}
{{- $new = append $new $t -}}
{{- end -}}
{{- $_ := set $req "nodeSelectorTerms" $new -}}
{{- $_ := set $na "requiredDuringSchedulingIgnoredDuringExecution" $req -}}
{{- $_ := set $aff "nodeAffinity" $na -}}
{{- end -}}
{{- if $aff }}{{ toYaml $aff }}{{ end -}}
{{- end }}

{{- define "gpufrac.image" -}}
{{- $repo := required "image.repository is required: the registry path you pushed the agent image to (see deploy/daemonset/Dockerfile), e.g. --set image.repository=registry.example.com/gpufrac/agent" .Values.image.repository -}}
{{- if .Values.image.digest -}}
{{ $repo }}@{{ .Values.image.digest }}
{{- else -}}
{{ $repo }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end }}
