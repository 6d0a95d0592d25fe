{{/*
The chart name, truncated to 63 characters (the DNS label limit).
*/}}
{{- define "lora-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every resource name: `<release>-<chart>`, or the release name alone when it already
contains the chart name. Truncated so that suffixes such as `-inference` still fit in 63.
*/}}
{{- define "lora-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "lora-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels on every object.
*/}}
{{- define "lora-operator.labels" -}}
helm.sh/chart: {{ include "lora-operator.chart" . }}
{{ include "lora-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: lora-operator
{{- end }}

{{/*
Labels that select this release's objects; each Deployment adds app.kubernetes.io/component.
*/}}
{{- define "lora-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "lora-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "lora-operator.operator.name" -}}
{{- printf "%s-operator" (include "lora-operator.fullname" .) }}
{{- end }}

{{- define "lora-operator.inference.name" -}}
{{- printf "%s-inference" (include "lora-operator.fullname" .) }}
{{- end }}

{{/*
The Service that reaches the inference pods themselves (the router watches its EndpointSlices).
*/}}
{{- define "lora-operator.inferencePods.name" -}}
{{- printf "%s-inference-pods" (include "lora-operator.fullname" .) }}
{{- end }}

{{- define "lora-operator.router.name" -}}
{{- printf "%s-router" (include "lora-operator.fullname" .) }}
{{- end }}

{{/*
Whether the router runs: it fronts the chart's own inference pods, so it needs them.
*/}}
{{- define "lora-operator.router.enabled" -}}
{{- if and .Values.router.enabled .Values.inference.enabled }}true{{ end }}
{{- end }}

{{- define "lora-operator.router.serviceAccountName" -}}
{{- if .Values.router.serviceAccount.create }}
{{- default (include "lora-operator.router.name" .) .Values.router.serviceAccount.name }}
{{- else }}
{{- required "router.serviceAccount.name is required when router.serviceAccount.create is false" .Values.router.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "lora-operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (include "lora-operator.operator.name" .) .Values.operator.serviceAccount.name }}
{{- else }}
{{- required "operator.serviceAccount.name is required when operator.serviceAccount.create is false" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
kopf's peering object name, shared by every operator replica (`--peering=<this>`).
*/}}
{{- define "lora-operator.peeringName" -}}
{{- include "lora-operator.fullname" . }}
{{- end }}

{{- define "lora-operator.peering" -}}
{{- if gt (int .Values.operator.replicas) 1 }}true{{ end }}
{{- end }}

{{- define "lora-operator.adapterClaimName" -}}
{{- if .Values.adapterVolume.existingClaim }}
{{- .Values.adapterVolume.existingClaim }}
{{- else }}
{{- printf "%s-adapters" (include "lora-operator.fullname" .) }}
{{- end }}
{{- end }}

{{- define "lora-operator.adminTokenSecretName" -}}
{{- if .Values.adminToken.existingSecret }}
{{- .Values.adminToken.existingSecret }}
{{- else }}
{{- printf "%s-admin-token" (include "lora-operator.fullname" .) }}
{{- end }}
{{- end }}

{{/*
Where the admin token Secret is mounted, in the operator and in inference pods.
*/}}
{{- define "lora-operator.adminTokenDir" -}}
/var/run/lora/admin-token
{{- end }}

{{- define "lora-operator.clientTokenDir" -}}
/var/run/lora/client-token
{{- end }}

{{/*
An image reference: (dict "root" $ "image" <a component's image values> "component" "operator"|"inference").
The repository is the component's own, else `<image.registry>/lora-operator/<component>`; the
tag is the component's, else the chart's appVersion. The chart names no registry of its own: a
default such as `lora-operator/operator` would be Docker Hub's, where anyone may publish under
that name, and every install would run that image with the operator's rights. So an install
that names neither fails here, saying what to set.
*/}}
{{- define "lora-operator.image" -}}
{{- $repository := .image.repository }}
{{- if not $repository }}
{{- $registry := required (printf "image.registry is required: set it to the registry you pushed the lora-operator images to with `make push REGISTRY=<registry>/lora-operator` (e.g. -f examples/values-my-registry.yaml, or --set image.registry=registry.example.com), or name the %s image in %s.image.repository. The chart has no default registry, so that no install or upgrade pulls an image someone else published under these names" .component .component) .root.Values.image.registry }}
{{- $repository = printf "%s/lora-operator/%s" (trimSuffix "/" $registry) .component }}
{{- end }}
{{- printf "%s:%s" $repository (default .root.Chart.AppVersion .image.tag) }}
{{- end }}

{{/*
A component's topologySpreadConstraints: (dict "root" $ "constraints" <the values' list>
"component" "operator"|"inference"|"router", and for one model's pods "selector" its labels). A constraint without labelSelector selects that
component's pods of the release, which is what spreading them means; one with its own is kept
as written.
*/}}
{{- define "lora-operator.topologySpread" -}}
{{- $selector := fromYaml (include "lora-operator.selectorLabels" .root) }}
{{- $_ := set $selector "app.kubernetes.io/component" .component }}
{{- range $k, $v := .selector }}
{{- $_ := set $selector $k $v }}
{{- end }}
{{- $out := list }}
{{- range .constraints }}
{{- $c := deepCopy . }}
{{- if not (hasKey $c "labelSelector") }}
{{- $_ := set $c "labelSelector" (dict "matchLabels" $selector) }}
{{- end }}
{{- $out = append $out $c }}
{{- end }}
{{- toYaml $out }}
{{- end }}

{{/*
The `job` label the chart's monitors give a component's series and its alerts select:
(dict "root" $ "component" "operator"|"inference").
*/}}
{{- define "lora-operator.metricsJob" -}}
{{- printf "%s-%s" (include "lora-operator.fullname" .root) .component }}
{{- end }}

{{/*
The CRD annotations: `helm.sh/resource-policy: keep` when crds.keep is on.
*/}}
{{- define "lora-operator.crdAnnotations" -}}
{{- if .Values.crds.keep }}
helm.sh/resource-policy: keep
{{- end }}
{{- end }}

{{/*
Contradictory values fail here, with a message that says what to change. The operator Deployment
includes it, and helm renders every template, so any install or template reports them.
*/}}
{{- define "lora-operator.validate" -}}
{{- if and (not .Values.adapterVolume.create) (not .Values.adapterVolume.existingClaim) }}
{{- fail "adapterVolume: set adapterVolume.create=true or name adapterVolume.existingClaim; the operator and inference pods need the shared adapter volume" }}
{{- end }}
{{- if .Values.inference.enabled }}
{{- range $m := include "lora-operator.models" . | fromJsonArray }}
{{- $where := ternary "inference" (printf "inference.models[%s]" $m.servedModelName) (empty $m.selector) }}
{{- if and $m.model.existingClaim (not (hasPrefix "/models/" $m.model.path)) }}
{{- fail (printf "%s.model.path must be under /models/ when %s.model.existingClaim is set (the claim is mounted at /models); got %q" $where $where $m.model.path) }}
{{- end }}
{{- if and $m.gpu.enabled (eq $m.device "cpu") }}
{{- fail (printf "%s.device is cpu but %s.gpu.enabled is true: the GPU would sit idle; set %s.gpu.enabled=false or %s.device=cuda" $where $where $where $where) }}
{{- end }}
{{- if lt (int $m.maxCpuLoras) (int $m.maxLoras) }}
{{- fail (printf "%s.maxCpuLoras (%d) must be at least %s.maxLoras (%d)" $where (int $m.maxCpuLoras) $where (int $m.maxLoras)) }}
{{- end }}
{{- if and $m.autoscaling.enabled (gt (int $m.autoscaling.minReplicas) (int $m.autoscaling.maxReplicas)) }}
{{- fail (printf "%s.autoscaling.minReplicas (%d) is above %s.autoscaling.maxReplicas (%d)" $where (int $m.autoscaling.minReplicas) $where (int $m.autoscaling.maxReplicas)) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and .Values.metrics.serviceMonitor.enabled .Values.metrics.podMonitor.enabled }}
{{- fail "metrics: enable metrics.serviceMonitor or metrics.podMonitor, not both: every series would be scraped twice" }}
{{- end }}
{{- if and .Values.metrics.serviceMonitor.enabled (not .Values.operator.service.enabled) }}
{{- fail "metrics.serviceMonitor needs operator.service.enabled=true (it scrapes the operator's Service); or use metrics.podMonitor" }}
{{- end }}
{{- if and .Values.metrics.prometheusRule.enabled (not (or .Values.metrics.serviceMonitor.enabled .Values.metrics.podMonitor.enabled)) }}
{{- fail "metrics.prometheusRule needs metrics.serviceMonitor.enabled or metrics.podMonitor.enabled: its alerts select the job labels those monitors set" }}
{{- end }}
{{- if and .Values.networkPolicy.enabled (not .Values.networkPolicy.allowFrom) (or .Values.inference.enabled (include "lora-operator.router.enabled" .)) }}
{{- fail "networkPolicy.allowFrom is empty: with networkPolicy.enabled only its peers reach the router and the inference pods, so no client could generate; name your gateway, clients and Prometheus there" }}
{{- end }}
{{- $reserved := list "adapters" "admin-token" "client-token" "model" "podinfo" "tmp" }}
{{- range $component := list "operator" "inference" "router" }}
{{- range (index $.Values $component).extraVolumes }}
{{- if has .name $reserved }}
{{- fail (printf "%s.extraVolumes: %q is the name of one of the chart's own volumes (%s); name yours differently" $component .name (join ", " $reserved)) }}
{{- end }}
{{- end }}
{{- end }}
{{- if not (hasPrefix "/" .Values.volumeRoot) }}
{{- fail (printf "volumeRoot must be an absolute path; got %q" .Values.volumeRoot) }}
{{- end }}
{{- end }}

{{/*
The rules of the operator's work, in a ClusterRole (all namespaces) or a Role per watched
namespace (templates/rbac.yaml). Each comment says why the operator needs the rule.
*/}}
{{- define "lora-operator.secretRules" -}}
# Only the Secrets named in a LoRAAdapter's spec.source.secretRef (hf/s3/https credentials), read
# one by one when staging, and only in the namespaces operator.secretNamespaces (or
# watchNamespaces) names. RBAC cannot name the Secrets in advance (users choose the names), so
# this is get on Secrets of the namespace; never list or watch, so the operator cannot
# enumerate them.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
{{- end }}

{{- define "lora-operator.workRules" -}}
# The LoRAAdapters themselves: kopf lists and watches them, and patches them to add its finalizer
# (so deletion unloads the adapter from every pod first) and its progress annotations. The
# operator never creates or deletes an adapter.
- apiGroups: [lora.dev]
  resources: [loraadapters]
  verbs: [get, list, watch, patch]
# The status the operator reports (phase, conditions, one entry per pod); a subresource.
- apiGroups: [lora.dev]
  resources: [loraadapters/status]
  verbs: [get, patch]
# Inference pods (label lora.dev/inference=true): their IP, readiness and restarts tell the
# operator where to load adapters. It reads them and never changes them.
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
# An inference pod's owner chain (Pod -> ReplicaSet -> Deployment, or -> StatefulSet), read
# by name and matched by UID: only pods it ends at one of the release's workloads get tokens
# and loads. Read one by one, never listed or watched, never changed.
- apiGroups: [apps]
  resources: [replicasets, deployments, statefulsets]
  verbs: [get]
# Events on the LoRAAdapters (Ready, Degraded, LoadFailed... and why), so `kubectl describe lora`
# shows them: one events.k8s.io Event per transition, and a patch of its series count when the
# same transition repeats. It never reads, lists or deletes events.
- apiGroups: [events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- end }}

{{/*
The base models the release serves (inference.models, or the list of one made of inference's
own servedModelName and model), as a JSON list: each entry is inference's values with the
model's own over them (a map key by key), plus
- objectName: its Deployment's, PodDisruptionBudget's, NetworkPolicy's and HPA's name (and, in
  a release of several models, its Service's): `<fullname>-inference`, or
  `<fullname>-inference-<name>` for each listed model;
- selector: the labels that select its pods besides the release's and the component's (none
  for the list of one, so a single-model release keeps the selector it always had);
- servedModelName: what its pods report and its adapters name in spec.baseModel.
Templates range over it: `range $m := include "lora-operator.models" . | fromJsonArray`.
*/}}
{{- define "lora-operator.models" -}}
{{- $inf := .Values.inference }}
{{- $base := omit $inf "enabled" "models" "service" "clientToken" }}
{{- $out := list }}
{{- if not $inf.models }}
{{- $m := deepCopy $base }}
{{- $_ := set $m "objectName" (include "lora-operator.inference.name" .) }}
{{- $_ := set $m "selector" dict }}
{{- $out = append $out $m }}
{{- else }}
{{- $names := list }}
{{- range $i, $entry := $inf.models }}
{{- /* values.schema.json holds each entry to a name of lower-case letters, digits and '-',
and to the keys a model may set (not the release's enabled, service, clientToken). */}}
{{- $name := $entry.name | toString }}
{{- if has $name $names }}
{{- fail (printf "inference.models: %q is listed twice; each model once" $name) }}
{{- end }}
{{- $names = append $names $name }}
{{- $m := deepCopy $base }}
{{- range $key, $value := omit $entry "name" }}
{{- if and (kindIs "map" $value) (kindIs "map" (index $m $key)) }}
{{- $merged := deepCopy (index $m $key) }}
{{- range $k, $v := $value }}
{{- $_ := set $merged $k $v }}
{{- end }}
{{- $_ := set $m $key $merged }}
{{- else }}
{{- $_ := set $m $key $value }}
{{- end }}
{{- end }}
{{- $objectName := printf "%s-%s" (include "lora-operator.inference.name" $) $name }}
{{- if gt (len $objectName) 63 }}
{{- fail (printf "inference.models[%d].name %q: %s is longer than the 63 characters a Service name may have; shorten the model's name or fullnameOverride" $i $name $objectName) }}
{{- end }}
{{- $_ := set $m "servedModelName" $name }}
{{- $_ := set $m "objectName" $objectName }}
{{- $_ := set $m "selector" (dict "lora.dev/model" $name) }}
{{- $out = append $out $m }}
{{- end }}
{{- end }}
{{- toJson $out }}
{{- end }}
